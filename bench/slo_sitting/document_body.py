"""Part (b)'s document as a ready /v1/completions body (bench/run_slo_sitting.sh), written
before the chat streams start, so that sending it is one `curl` (a `kvserve bench serve`
run started beside the streams imported transformers and built its prompt on the same two
cores while they decoded: the engine's 4-row decode steps took 150-220 ms then, against
25 ms planned, in the 2026-12-08 sitting's step log).

    python bench/slo_sitting/document_body.py --tokenizer DIR --model NAME --len 8000 \
        --seed 41 --out body.json

The prompt is `kvserve bench serve --dataset-name random`'s for that length and seed (text
that tokenizes to about `--len` tokens), with max_tokens 1 and ignore_eos.
"""

from __future__ import annotations

import argparse
import json

from kvserve.benchmarks.datasets import load_tokenizer, random_requests


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="the model folder")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--len", type=int, default=8000, help="prompt tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where the JSON body goes")
    args = parser.parse_args()
    (request,) = random_requests(load_tokenizer(args.tokenizer), 1, args.len, 1, seed=args.seed)
    body = {
        "model": args.model,
        "prompt": request.prompt,
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(body, f)
    print(f"{args.out}: a prompt of {request.prompt_len} tokens")


if __name__ == "__main__":
    main()
