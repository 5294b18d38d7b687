"""Write docs/grafana/kvserve-vllm.json: kvserve.json for `--metrics-prefix vllm`.

    python docs/grafana/make_vllm_board.py

Every metric name in the board (queries, variables, texts) goes through the server's own
table (services/api/observability/metric_names.py: `exposed_name`), so a series vLLM also has is
queried under its `vllm:` name and a kvserve-only one keeps its `kvserve:` name. Edit kvserve.json,
then run this; tests/e2e/test_metrics_vllm_names.py fails while the two disagree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvserve.services.api.observability.metric_names import exposed_name

BOARDS = Path(__file__).resolve().parent
SOURCE, TARGET = BOARDS / "kvserve.json", BOARDS / "kvserve-vllm.json"
_KVSERVE_NAME = re.compile(r"kvserve:[A-Za-z0-9_:]+")


def _rename(node):
    if isinstance(node, str):
        return _KVSERVE_NAME.sub(lambda m: exposed_name(m.group(0), "vllm"), node)
    if isinstance(node, list):
        return [_rename(item) for item in node]
    if isinstance(node, dict):
        return {key: _rename(value) for key, value in node.items()}
    return node


def vllm_board(board: dict) -> dict:
    """`board` with vLLM's names, its own uid and title (both boards can be imported)."""
    renamed = _rename(board)
    renamed["uid"] = board["uid"] + "-vllm-names"
    renamed["title"] = board["title"] + " (--metrics-prefix vllm)"
    renamed["description"] = (
        "kvserve serve --metrics-prefix vllm: vLLM's names where vLLM has the series, kvserve: "
        "for kvserve's own (services/api/observability/metric_names.py). Generated from "
        "kvserve.json by make_vllm_board.py."
    )
    return renamed


def board_text(board: dict) -> str:
    return json.dumps(board, indent=2) + "\n"


if __name__ == "__main__":
    TARGET.write_text(board_text(vllm_board(json.loads(SOURCE.read_text()))))
    print(f"wrote {TARGET}")
