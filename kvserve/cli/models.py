"""`kvserve models`: the model families kvserve serves (a checkpoint's config.json
`model_type`), and what runs for each."""

from __future__ import annotations

import argparse
import json


def add_models(sub) -> None:
    p = sub.add_parser(
        "models", help="the model families kvserve serves, by config.json's model_type",
        description="The architectures kvserve implements, selected by the `model_type` in a "
                    "checkpoint's config.json (`--model DIR`): a model of any other type is "
                    "refused at load, naming its type. For each: tensor parallelism, GGUF "
                    "block codes on CPUs, structured outputs, speculative decoding, and notes. "
                    "docs/models.md has the details.")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list: model_type, name, examples, qkv_bias, qk_norm, "
                        "tensor_parallel, block_codes, structured_outputs, speculative, notes")
    p.set_defaults(run=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from kvserve.columns import aligned
    from kvserve.workers.model_executor.families import FAMILIES

    if args.json:
        print(json.dumps([f.to_dict() for f in FAMILIES.values()]))
        return 0
    head = ("MODEL_TYPE", "FAMILY", "EXAMPLES", "TP", "BLOCK CODES", "STRUCTURED", "SPECULATIVE")
    rows = [head] + [
        (f.model_type, f.name, f.examples, *("yes" if v else "no" for v in (
            f.tensor_parallel, f.block_codes, f.structured_outputs, f.speculative)))
        for f in FAMILIES.values()]
    print("\n".join(aligned(rows)))
    for f in FAMILIES.values():
        if f.notes:
            print(f"{f.model_type}: {f.notes}")
    return 0
