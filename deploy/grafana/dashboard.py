"""The carryover Grafana dashboard, built with Grafana's foundation SDK (typed builders
generated from Grafana's own schemas).

``uv run python deploy/grafana/dashboard.py > deploy/grafana/carryover.json`` writes the file
Grafana is provisioned with (compose.yaml's ``observability`` profile);
``tests/unit/test_dashboard.py`` checks that the file is this script's output and that every
metric it queries is one the router or vLLM exports.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

__all__ = ["build", "render"]

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"


def _query(expr: str, legend: str) -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


def _panel(title: str, unit: str, description: str, *queries: Dataquery) -> Panel:
    panel = Panel().title(title).unit(unit).description(description).datasource(DATASOURCE)
    panel = panel.height(8).span(12)
    for ref, query in zip("ABCDEFGH", queries, strict=False):
        panel = panel.with_target(query.ref_id(ref))
    return panel


def _quantile(q: float, histogram: str, by: str, where: str = "") -> str:
    selector = f"{{{where}}}" if where else ""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{selector}{RATE})))"


def build() -> Dashboard:
    ttft = "carryover_ttft_seconds"
    return (
        Dashboard("carryover")
        .uid("carryover")
        .description("Turn-N TTFT, reuse and the router's health (carryover's /metrics).")
        .tags(["carryover", "vllm", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_row(Row("Turns"))
        .with_panel(
            _panel(
                "Time to first token by turn, p50",
                "s",
                "Streamed turns; turn N should start as fast as turn 1.",
                _query(_quantile(0.5, ttft, "turn"), "turn {{turn}}"),
            )
        )
        .with_panel(
            _panel(
                "Time to first token by turn, p99",
                "s",
                "Streamed turns.",
                _query(_quantile(0.99, ttft, "turn"), "turn {{turn}}"),
            )
        )
        .with_panel(
            _panel(
                "Prompt ready at D by turn, p50 (streamed or not)",
                "s",
                "Arrival to P's answer: what a handle shortens, for agent backends' whole "
                "answers too. Requests without a conversation have no turn.",
                _query(
                    _quantile(0.5, "carryover_prefill_done_seconds", "turn", 'turn!=""'),
                    "turn {{turn}}",
                ),
            )
        )
        .with_panel(
            _panel(
                "Whole answer by turn, p50",
                "s",
                "Arrival to the last byte, streamed and not.",
                _query(
                    _quantile(0.5, "carryover_answer_seconds", "turn, stream", 'turn!=""'),
                    "turn {{turn}} stream={{stream}}",
                ),
            )
        )
        .with_panel(
            _panel(
                "Turns by path",
                "reqps",
                "reuse, partial, warm, decode-local and the cold paths (docs/operations.md, X-Carryover-Path).",
                _query(f"sum by (path) (rate(carryover_turns_total{RATE}))", "{{path}}"),
            )
        )
        .with_panel(
            _panel(
                "Reuse share and prefill saved",
                "percentunit",
                "Share of turns that attached a handle, and of prompt tokens P did not compute.",
                _query(
                    f'sum(rate(carryover_turns_total{{path=~"reuse|partial"}}{RATE})) '
                    f"/ sum(rate(carryover_turns_total{RATE}))",
                    "turns reusing a handle",
                ),
                _query(
                    f'sum(rate(carryover_prompt_tokens_total{{kind="reused"}}{RATE})) '
                    f"/ sum(rate(carryover_prompt_tokens_total{RATE}))",
                    "prompt tokens reused",
                ),
            )
        )
        .with_panel(
            _panel(
                "Prompt tokens per second: reused vs computed",
                "short",
                "Reused tokens came from D (or the warm tier): prefill saved.",
                _query(f"sum by (kind) (rate(carryover_prompt_tokens_total{RATE}))", "{{kind}}"),
                _query(f"sum(rate(carryover_warm_tier_tokens_total{RATE}))", "from the warm tier"),
            )
        )
        .with_panel(
            _panel(
                "Inter-token latency (engines)",
                "s",
                "vLLM's own histogram on the decode instances.",
                _query(
                    _quantile(0.5, "vllm:inter_token_latency_seconds", "instance"),
                    "p50 {{instance}}",
                ),
                _query(
                    _quantile(0.99, "vllm:inter_token_latency_seconds", "instance"),
                    "p99 {{instance}}",
                ),
            )
        )
        .with_row(Row("Health"))
        .with_panel(
            _panel(
                "Responses by status and error",
                "reqps",
                "Every inference response by HTTP status and error type, and streams that "
                "ended in an error event after their 200.",
                _query(
                    f"sum by (status, error) (rate(carryover_responses_total{RATE}))",
                    "{{status}} {{error}}",
                ),
                _query(
                    f"sum by (error) (rate(carryover_stream_errors_total{RATE}))",
                    "mid-stream {{error}}",
                ),
            )
        )
        .with_panel(
            _panel(
                "Retries and breakers",
                "short",
                "Retries by cause (per second) and open circuit breakers.",
                _query(f"sum by (cause) (rate(carryover_retries_total{RATE}))", "{{cause}}"),
                _query("sum by (server) (carryover_breaker_open)", "open: {{server}}"),
            )
        )
        .with_panel(
            _panel(
                "Store latency and errors",
                "s",
                "Claim and commit calls (p99), and failed store calls per second.",
                _query(
                    _quantile(0.99, "carryover_leg_seconds", "leg", 'leg=~"claim|commit"'),
                    "p99 {{leg}}",
                ),
                _query(f"sum by (op) (rate(carryover_store_errors_total{RATE}))", "errors {{op}}"),
            )
        )
        .with_panel(
            _panel(
                "Handles held per decode instance",
                "short",
                "Stored handles whose blocks each D keeps pinned.",
                _query("max by (server) (carryover_decode_handles)", "{{server}}"),
            )
        )
        .with_panel(
            _panel(
                "Oldest held handle",
                "s",
                "Age of the oldest stored handle per D (it expires at decoder_kv_blocks_ttl).",
                _query(
                    "max by (server) (carryover_decode_handle_oldest_age_seconds)",
                    "{{server}}",
                ),
            )
        )
        .with_panel(
            _panel(
                "KV-event index lag",
                "s",
                "Age of each engine's newest KV-event batch when the router applied it.",
                _query("max by (server) (carryover_kv_event_lag_seconds)", "{{server}}"),
            )
        )
        .with_panel(
            _panel(
                "Warm tier",
                "short",
                "Turns the warm tier served (hit) or could not (down), and whether it is up.",
                _query(
                    f"sum by (outcome) (rate(carryover_warm_tier_turns_total{RATE}))",
                    "{{outcome}}",
                ),
                _query("min by (tier) (carryover_warm_tier_up)", "up: {{tier}}"),
            )
        )
    )


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


if __name__ == "__main__":
    print(render(), end="")
