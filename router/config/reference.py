"""docs/configuration.md, written from the keys (``keys.py``): a test keeps the file equal to
this output. Regenerate: ``python -m carryover.router.config.reference > docs/configuration.md``."""

from __future__ import annotations

import sys

from carryover.router.config.keys import Key, Kind, Scope, keys
from carryover.router.config.load import CONFIG_FILE_ENV

__all__ = ["reference"]

_INTRO = f"""# Configuration reference

Generated from the configuration Structs (`router/config/`) by
`python -m carryover.router.config.reference`; a test keeps this file equal to the code.

Every key can be set in a TOML file (`carryover serve --config FILE`, or `{CONFIG_FILE_ENV}`),
by a `CARRYOVER_*` variable, or by a flag; a flag wins over a variable, a variable over the
file, the file over the default. Durations are in seconds, sizes in bytes unless the name
says otherwise. A setting that cannot work stops `carryover serve` with one line naming it
and exit status 2.

- Switches take `--x` / `--no-x`, and `true`, `false`, `1` or `0` in a variable.
- Lists take the flag repeated, or values separated by commas (in a variable too).
- Tables (`api_keys`, `tenant_limits`) take a JSON object as a flag or variable.
- Secrets (`api_keys`, `admin_key`) have no flag (a command line is readable by every user
  of the machine): a variable, or better a file (`api_keys_file`, `admin_key_file`).
  A Redis password goes in `redis_options.password_file` or `CARRYOVER_REDIS_PASSWORD`.
- Engine URLs are `http://HOST:PORT`, or `dns://NAME:PORT` for every address a name
  resolves to (docs/discovery.md). `https://` engines are refused at startup: the router
  speaks plain HTTP/1.1 to engines on a private network.
"""

_SECTIONS = {
    Scope.ROUTER: (
        "The router: `[router]`",
        '```toml\n[router]\nport = 8000\nredis = "redis://redis:6379/0"\n\n'
        "[router.timeouts]\nrequest = 900.0\n```",
    ),
    Scope.MODEL: (
        "Each model: `[[models]]`",
        "Flags and variables set up one model, or apply to every model of the file.\n\n"
        '```toml\n[[models]]\nname = "Qwen/Qwen3-8B"\nblock_size = 16\n'
        'prefill = [{url = "http://p0:8000"}]\ndecode = [{url = "dns://vllm-decode:8000"}]\n'
        '\n[models.render]\npath = "/models/qwen3-8b"\n```',
    ),
    Scope.INSTANCE: (
        "Each instance: `prefill = [{url = …, …}]`, `decode = [...]`",
        "As a flag or variable, `INSTANCE=VALUE` with INSTANCE the instance's URL or name, "
        "repeated or separated by commas: `--kv-events http://p0:8000=tcp://p0:5557`.",
    ),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(key: Key) -> str:
    value = key.default
    if key.name == "decode":
        return "required"
    if value is None or key.kind in (Kind.INSTANCES, Kind.FILE):
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ", ".join(f"`{v}`" for v in value) or "none"
    if isinstance(value, dict):
        return f"`{value}`" if value else "none"
    return f"`{value}`"


def _row(key: Key) -> str:
    flag = "—" if key.flag is None else f"`{key.flag}`"
    if key.kind is Kind.SWITCH and key.flag:
        flag = f"`{key.flag}`, `--no-{key.flag[2:]}`"
    cells = (f"`{key.name}`", key.type_name, _default(key), flag, f"`{key.env}`", key.about)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def reference() -> str:
    out = [_INTRO]
    for scope, (title, intro) in _SECTIONS.items():
        out += [f"## {title}\n", intro, "", "| key | type | default | flag | variable | meaning |"]
        out.append("|---|---|---|---|---|---|")
        out += [_row(k) for k in keys() if k.scope is scope and not k.hidden]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(reference())
