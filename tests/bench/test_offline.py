"""`bench offline`: continuous vs static batching of the engine, with the lab's definitions."""

import pytest

from iterserve.bench.offline import CountingExecutor, run_offline
from iterserve.errors import OfflineBenchError


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir


def test_static_batching_takes_more_steps_at_lower_utilisation_for_the_same_tokens(tiny_dir):
    doc = run_offline(model=str(tiny_dir), num_requests=6, max_num_seqs=3,
                      modes=["continuous", "static"], num_kv_blocks=256)
    cont, static = doc["runs"]
    assert cont["batching"] == "continuous" and static["batching"] == "static"
    assert cont["output_tokens"] == static["output_tokens"] == doc["workload"]["total_output_tokens"]
    assert static["steps"] > cont["steps"]
    assert 0 < static["slot_utilisation"] < cont["slot_utilisation"] <= 1
    for run in doc["runs"]:
        assert run["output_throughput"] > 0 and run["mean_latency_s"] > 0
        assert run["forward_s"] <= run["wall_s"]


def test_bad_modes_and_workloads_with_arrivals_are_rejected():
    with pytest.raises(OfflineBenchError, match="batching"):
        run_offline(modes=["dynamic"])
    with pytest.raises(OfflineBenchError, match="arrival"):
        run_offline(workload="longprompt")
    with pytest.raises(OfflineBenchError, match="max_num_seqs"):
        run_offline(max_num_seqs=0)


def test_the_counting_executor_counts_chunks_and_delegates():
    class Inner:
        name = "inner"

        def execute(self, out):
            return {"r": 1}

    class Out:
        def __init__(self, n):
            self.num_scheduled_tokens = {f"r{i}": 1 for i in range(n)}

    ex = CountingExecutor(Inner())
    assert ex.execute(Out(3)) == {"r": 1} and ex.execute(Out(0)) == {"r": 1}
    assert (ex.steps, ex.busy_slot_steps, ex.name) == (1, 3, "inner")
