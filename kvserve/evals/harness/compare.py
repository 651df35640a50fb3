"""Check an lm-evaluation-harness run against kvserve's in-process engine.

    python -m kvserve.evals.harness.compare LM_EVAL_OUTPUT_DIR [--model M]

Reads the samples lm-eval logged (`--log_samples`) for the `kvserve_closed_book` task, asks the
in-process engine the same prompts (chat messages, with `local-chat-completions`; plain text
with `local-completions`) with the same generation settings (greedy, `until` as stop strings,
`max_gen_toks`), and prints, as JSON: how many answers are identical, both scores (the task's
own `utils.contains_answer`), and any differing answer. Exit 0 only when every answer is the
same, so the harness scored exactly what the engine says.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvserve.evals.harness.utils import contains_answer
from kvserve.workers.config import EngineConfig
from kvserve.workers.engine import LLMEngine

TASK = "kvserve_closed_book"


def read_samples(output_dir: Path) -> list[dict[str, Any]]:
    files = sorted(output_dir.rglob(f"samples_{TASK}_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no samples_{TASK}_*.jsonl under {output_dir} "
                                "(run lm_eval with --log_samples --output_path DIR)")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def engine_answers(engine: LLMEngine, samples: list[dict[str, Any]]) -> list[str]:
    requests = []
    for i, sample in enumerate(samples):
        prompt, kwargs = sample["arguments"]["gen_args_0"]["arg_0"], \
            sample["arguments"]["gen_args_0"]["arg_1"]
        # chat: a list holding the messages as JSON text; plain completions: the prompt text
        source = {"messages": json.loads(prompt[0])} if isinstance(prompt, list) \
            else {"prompt": prompt}
        requests.append({**source, "request_id": f"s{i}", "params": {
            "temperature": 0.0, "max_tokens": kwargs.get("max_gen_toks", 16),
            "stop": list(kwargs.get("until", []))}})
    outputs = engine.generate_all(requests)
    return ["".join(o.text for o in outputs[f"s{i}"]) for i in range(len(samples))]


def compare(samples: list[dict[str, Any]], answers: list[str]) -> dict[str, Any]:
    harness = [s["resps"][0][0] for s in samples]
    differ = [{"doc": s["doc_id"], "harness": h, "engine": a}
              for s, h, a in zip(samples, harness, answers, strict=True) if h != a]

    def score(texts: list[str]) -> float:
        hits = [contains_answer(t, s["doc"]["answers"])
                for t, s in zip(texts, samples, strict=True)]
        return sum(hits) / len(hits)

    return {"samples": len(samples), "identical": len(samples) - len(differ),
            "harness_score": sum(s["contains_answer"] for s in samples) / len(samples),
            "engine_score": score(answers), "differ": differ}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path, help="lm_eval's --output_path")
    parser.add_argument("--model", default=None, help="the served model (default: kvserve's)")
    args = parser.parse_args(argv)
    samples = read_samples(args.output_dir)
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu"))
    report = compare(samples, engine_answers(engine, samples))
    print(json.dumps(report, indent=2))
    return 0 if not report["differ"] else 1


if __name__ == "__main__":
    sys.exit(main())
