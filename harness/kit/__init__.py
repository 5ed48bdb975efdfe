"""End-to-end kit: run a real vLLM engine over a prefix-sharing workload and judge its output.

Runs on the host, outside the engine. The parent process never imports vLLM; each
`run_engine` call starts ONE engine in a fresh child (`python -m harness.kit.child engine
SPEC OUT`), so every run starts cold and runs with and without a connector are comparable.

- `Workload`: seeded requests with shared prefixes (a system prompt, a multi-turn chat whose
  turns extend the previous prompt *and its real output*, a document asked about several
  times, and a salted repeat that must stay a miss).
- `run_engine`: sends the requests one at a time (greedy, with logprobs) and returns an
  `EngineResult`. TTFT is vLLM's own per-request `first_token_latency` (wall clock from
  the frontend's arrival stamp to the frontend receiving the first token, filled because we
  start the engine with `disable_log_stats=False`): it includes scheduling, any connector
  lookup and load, the prefill and the output path.
- `compare_outputs`: the correctness oracle (identical greedy tokens, chosen-token logprobs
  within a tolerance). `summarize`: TTFT percentiles for misses and hits.
"""

from harness.kit.oracle import (
    DEFAULT_LOGPROB_TOL,
    LOGPROB_TOL,
    Comparison,
    Percentiles,
    TTFTSummary,
    compare_outputs,
    percentile,
    percentiles,
    summarize,
)
from harness.kit.runner import (
    PROJECT_ROOT,
    TTFT_METHOD,
    EngineResult,
    EngineRunError,
    RequestResult,
    open_barrier,
    run_engine,
)
from harness.kit.workload import BLOCK_SIZE, Request, TokenSource, Workload, _TokenSource

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_LOGPROB_TOL",
    "LOGPROB_TOL",
    "PROJECT_ROOT",
    "Comparison",
    "EngineResult",
    "EngineRunError",
    "Percentiles",
    "Request",
    "RequestResult",
    "TTFTSummary",
    "TTFT_METHOD",
    "TokenSource",
    "Workload",
    "_TokenSource",
    "compare_outputs",
    "open_barrier",
    "percentile",
    "percentiles",
    "run_engine",
    "summarize",
]
