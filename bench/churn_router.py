"""The router of the churn soak (``carryover bench soak --churn``): ``carryover serve`` whose
``dns://`` entries resolve from a JSON file the soak rewrites (``{"name": ["127.0.0.5"]}``),
so DNS membership changes every few seconds without a DNS server. One worker.

``python -m carryover.bench.churn_router ADDRESSES.json [serve flags]``
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from carryover.router.config import ConfigError
from carryover.router.config.load import load_config
from carryover.router.fleet.discovery import Resolver

__all__ = ["file_resolver", "main"]


def file_resolver(path: Path) -> Resolver:
    """Addresses of a name as the file lists them now (read off the loop)."""

    async def resolve(name: str, port: int) -> list[str]:
        listed: dict[str, list[str]] = json.loads(await asyncio.to_thread(path.read_text))
        return sorted(listed.get(name, []))

    return resolve


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from carryover.router.cli import server_options
    from carryover.router.http.app import create_app
    from carryover.router.logs import configure_logging
    from carryover.router.memory import tune_malloc

    args = list(sys.argv[1:] if argv is None else argv)
    addresses, flags = Path(args[0]), args[1:]
    try:
        config = load_config(flags)
    except ConfigError as exc:
        print(f"carryover: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    configure_logging(config.log_level)
    tune_malloc()  # as a served worker does (router/http/asgi.py)
    uvicorn.run(create_app(config, resolver=file_resolver(addresses)), **server_options(config))


if __name__ == "__main__":
    main()
