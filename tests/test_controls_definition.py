"""Every entry point's keyword arguments against the one definition of the sampling controls
(flashsampling_cuda/controls.py): the same names in the same order, the same defaults, and each
control documented in docs/api.md. CPU, no GPU."""

import importlib
import inspect
from pathlib import Path

import pytest

from flashsampling_cuda.controls import DEFAULT_EXCEPTIONS, ENTRY_POINTS, SAMPLING_CONTROLS

DEFAULTS = {c.name: c.default for c in SAMPLING_CONTROLS}
# Keywords of an entry point that are not sampling controls (its own knobs), skipped in the order.
OWN_KEYWORDS = {"rtol", "max_chunk_elements", "logit_transform", "group", "draft_probs", "vocab_size"}


def resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_signature_matches_the_definition(entry_point):
    parameters = inspect.signature(resolve(entry_point)).parameters
    controls = [name for name, p in parameters.items()
                if name in DEFAULTS and p.default is not inspect.Parameter.empty and name not in OWN_KEYWORDS]
    assert tuple(controls) == ENTRY_POINTS[entry_point]
    for name in controls:
        want = DEFAULT_EXCEPTIONS.get((entry_point, name), DEFAULTS[name])
        assert parameters[name].default == want, f"{entry_point}: {name} defaults to {parameters[name].default!r}"
    unknown = [name for name, p in parameters.items() if p.default is not inspect.Parameter.empty
               and name not in DEFAULTS and name not in OWN_KEYWORDS]
    assert not unknown, f"{entry_point} takes keywords that controls.py does not define: {unknown}"


def test_every_control_is_documented():
    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [c.name for c in SAMPLING_CONTROLS if f"{c.name}=" not in api and f"`{c.name}`" not in api]
    assert not missing, f"docs/api.md does not mention {missing}"
