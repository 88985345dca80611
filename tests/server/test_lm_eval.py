"""lm-evaluation-harness against the server (issue 33): `lm_eval --model local-completions`
(loglikelihood: echo + logprobs on /v1/completions, batched prompts of token ids from a local
tokenizer) and `--model local-chat-completions --apply_chat_template` (generate_until) on a
task written here (tests/server/lm_eval_tasks: a YAML per task, an 8-question JSON-lines
set), fully offline (HF_HUB_OFFLINE and friends set; the dataset is read from the file, the
tokenizer from the model directory). Their scores, and every per-sample loglikelihood and
generation, equal lm-eval's own HF backend on the same weights (float32)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra "
                              "(pip install 'iterserve[test]')")

TASKS = Path(__file__).with_name("lm_eval_tasks")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(max_model_len=1024, num_kv_blocks=256)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf-datasets")
    return {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(cache),
            "HF_HOME": str(cache / "home")}


def _lm_eval_cli(args: list[str], out: Path, env: dict) -> dict[str, list[dict]]:
    """Run the `lm_eval` command as a user would; its samples per task, by doc_id."""
    cmd = [sys.executable, "-m", "lm_eval", *args, "--include_path", str(TASKS),
           "--output_path", str(out), "--log_samples"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.removeprefix("samples_").rsplit("_", 1)[0]
        samples[task] = sorted((json.loads(line) for line in f.open()),
                               key=lambda s: s["doc_id"])
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    return {"samples": samples, "results": results}


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    """lm-eval's HF backend on the same directory, in this process (torch is loaded)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    lm = HFLM(pretrained=str(tiny_model_dir), dtype="float32", device="cpu", batch_size=1)
    tm = TaskManager(include_path=str(TASKS))

    def run(task: str, **kw) -> dict:
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm,
                                      log_samples=True, **kw)
        return {"samples": sorted(out["samples"][task], key=lambda s: s["doc_id"]),
                "results": out["results"][task]}
    yield run
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _metric(results: dict, name: str) -> float:
    return results[f"{name},none"]


pytestmark = pytest.mark.slow           # each `lm_eval` command imports torch, datasets, ...


def test_local_completions_loglikelihood_equals_hf(srv, tiny_model_dir, tmp_path, env,
                                                    hf_reference):
    task = "iterserve_tiny_qa_mc"
    args = ["--model", "local-completions", "--model_args",
            f"model={srv.model},base_url={srv.v1}/completions,tokenizer={tiny_model_dir},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", "--batch_size", "4",
            "--tasks", task]
    served = _lm_eval_cli(args, tmp_path / "served", env)
    ref = hf_reference(task)
    got = served["samples"][task]
    assert len(got) == len(ref["samples"]) == 8
    lls = set()
    for s, r in zip(got, ref["samples"]):
        assert _requests(s["arguments"]) == [tuple(a) for a in r["arguments"]]
        for (ll, greedy), (ref_ll, ref_greedy) in zip(_scores(s), _scores(r)):
            assert math.isfinite(ll) and ll < 0
            assert ll == pytest.approx(ref_ll, abs=1e-4), (s["doc_id"], ll, ref_ll)
            assert greedy == ref_greedy
            lls.add(round(ll, 3))
    assert len(lls) > 8                    # real, differing scores, not one repeated value
    for m in ("acc", "acc_norm"):
        assert _metric(served["results"][task], m) == _metric(ref["results"], m)


def _requests(logged: dict) -> list[tuple]:
    """The CLI's logged form of a sample's requests ({"gen_args_0": {"arg_0": ..}}) as the
    in-process (context, continuation) tuples."""
    return [tuple(v[f"arg_{i}"] for i in range(len(v))) for v in logged.values()]


def _scores(sample: dict) -> list[tuple[float, str]]:
    """(loglikelihood, is_greedy) per choice; the CLI logs them as strings."""
    return [(float(resp[0][0]), str(resp[0][1])) for resp in sample["resps"]]


def test_local_chat_completions_generation_equals_hf(srv, tmp_path, env, hf_reference):
    task = "iterserve_tiny_qa_gen"
    args = ["--model", "local-chat-completions", "--model_args",
            f"model={srv.model},base_url={srv.v1}/chat/completions,num_concurrent=1,"
            "max_retries=1", "--apply_chat_template", "--tasks", task]
    served = _lm_eval_cli(args, tmp_path / "served", env)
    ref = hf_reference(task, apply_chat_template=True)
    got = served["samples"][task]
    assert len(got) == len(ref["samples"]) == 8
    assert [s["doc"] for s in got] == [r["doc"] for r in ref["samples"]]
    texts = [s["resps"] for s in got]
    assert texts == [r["resps"] for r in ref["samples"]]     # greedy, token for token
    assert all(t[0][0] for t in texts)                        # something was generated
    assert _metric(served["results"][task], "exact_match") == \
        _metric(ref["results"], "exact_match")
