import pytest
import torch

NO_CUDA_REASON = "no CUDA GPU: GPU tests run on the device machine"

# One intra-op thread by default: the float64 reference runs thousands of small
# elementwise ops, which a second thread slows down by 10x whenever the other core is
# busy (CI boxes have 2). The op's multi-threaded path is tested explicitly
# (test_sample_cpu.py::test_same_seed_and_offset_give_same_tokens_any_thread_count).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked requires_cuda are skipped, with a visible reason, where no GPU is."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_CUDA_REASON)
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
