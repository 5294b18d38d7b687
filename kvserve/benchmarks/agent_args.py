"""The flags of `kvserve bench serve --dataset-name agent` (agent.py runs it; kept apart so
that building the CLI imports no aiohttp)."""

from __future__ import annotations

import argparse


def add_agent_args(p: argparse.ArgumentParser) -> None:
    agent = p.add_argument_group("agent workload (--dataset-name agent)")
    agent.add_argument("--agent-num-conversations", type=int, default=16)
    agent.add_argument("--agent-turns", type=int, default=10)
    agent.add_argument("--agent-prefix-len", type=int, default=4000)
    agent.add_argument("--agent-turn-len", type=int, default=32, help="tokens of a user turn")
    agent.add_argument("--agent-output-len", type=int, default=32)
    agent.add_argument("--agent-think-s", default="2,10", help="MIN,MAX seconds between turns")
    agent.add_argument("--agent-api", choices=("messages", "chat"), default="messages")
    agent.add_argument("--agent-ttl", choices=("5m", "1h"), default="5m")
