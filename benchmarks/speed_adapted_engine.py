"""A `vllm-accel speed-adapt` output served by a real vLLM CPU engine with ACCEL_SPEED.

No cut flag is given: the engine must take the cut and anchor from the adapted model's config.
The engine answers needle prompts (the calibration set's cases, 1024 tokens by default); the
script reports each answer, needle accuracy, and whether the greedy tokens equal the PyTorch
oracle's on the same adapted weights (float32 on both sides).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/speed_adapted_engine.py \
        --adapted /tmp/adapt/qwen-0.75 --needles 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

MAX_TOKENS = 12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapted", required=True, help="a speed-adapt output directory")
    ap.add_argument("--needles", type=int, default=2, help="needles per depth (3 depths)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_accel.bench.harness import engine_settings, run_side
    from vllm_accel.quality import needle
    from vllm_accel.quality.prompts import load_tokenizer
    from vllm_accel.speed.config import ADAPTED_CONFIG_KEY
    from vllm_accel.speed.reference import speed_greedy

    config = json.loads(Path(args.adapted, "config.json").read_text())[ADAPTED_CONFIG_KEY]
    tok = load_tokenizer(args.adapted)
    cases = needle.build_cases(tok, [args.length], [0.1, 0.5, 0.9], seed=0,
                               needles_per_cell=args.needles)
    prompts = [c.prompt_ids for c in cases]
    settings = engine_settings(args.adapted, args.length + 64, 0.3,
                               {"attention_backend": "ACCEL_SPEED", "dtype": "float32"})
    task = {"kind": "generate", "name": "out", "prompts": prompts, "max_tokens": MAX_TOKENS,
            "sequential": True, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as logs:
        result = run_side("adapted", settings, [task], timeout_s=3600, log_dir=Path(logs))
        log = Path(logs, "adapted.log").read_text()
    engine = [o["token_ids"] for o in result["tasks"]["out"]]
    model = AutoModelForCausalLM.from_pretrained(args.adapted, dtype=torch.float32).eval()
    oracle = [speed_greedy(model, p, MAX_TOKENS, config["cut"], config["anchor_tokens"])
              for p in prompts]
    answers = [tok.decode(t, skip_special_tokens=True) for t in engine]
    out = {"adapted": args.adapted, "cut": config["cut"],
           "cut_from_config": f"cut={config['cut']!r} from the adapted model's config" in log,
           "needle_accuracy": sum(needle.score(c, a) for c, a in zip(cases, answers)) / len(cases),
           "oracle_identical": sum(e == o for e, o in zip(engine, oracle)), "prompts": len(cases),
           "answers": [{"expected": c.answer, "engine": a} for c, a in zip(cases, answers)]}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
