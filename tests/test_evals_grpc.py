"""Issue #5, acceptance 4: the same recall run against a local deployment over gRPC gives the
same per-sample answers as in-process (tests/test_evals_e2e.py checks the in-process answers
against transformers).

Its own module, so that only this test runs in the shared cluster's unit (one worker takes it
whole): the eval module's in-process tests (a minute of CPU) can run on another worker
meanwhile, and that unit, the longest path of a three-worker run (README: ci92-ci95), is that
much shorter. It pays for the in-process run it compares against (~11 CPU-s)."""

from __future__ import annotations

from kvserve.cli import main
from tests.serving import APP, DEFAULT_APP, serve_locally
from tests.test_evals_e2e import RECALL_ARGS, SAMPLES, records

USES_SHARED_RAY = "0"  # tests/serving.py: the first of the shared cluster's modules; starts it


def test_recall_over_grpc_answers_exactly_as_in_process(tmp_path, model_dir):
    assert main([*RECALL_ARGS, "--out", str(tmp_path / "local")]) == 0
    local = {r["key"]: r["response_token_ids"] for r in records(tmp_path / "local")}
    assert len(local) == sum(SAMPLES.values())
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        assert main([*RECALL_ARGS, "--out", str(tmp_path / "remote"), "--target",
                     served.target]) == 0
    remote = {r["key"]: r["response_token_ids"] for r in records(tmp_path / "remote")}
    assert remote == local
