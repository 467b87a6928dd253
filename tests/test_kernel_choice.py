"""The dispatch's kernel choice (csrc/include/flashsampling/kernel_choice.h), a pure function of
(architecture, loop, GEMM columns): checked on the CPU through torch.ops.flashsampling._kernel_choice,
against the units csrc/kernels/generate_kernels.py writes (no GPU, no child process); and the loop a
call needs (sampler_loop.h, through torch.ops.flashsampling._sampler_loop)."""

import sys
from pathlib import Path

import pytest
import torch

import flashsampling_cuda  # noqa: F401  (registers the ops)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "csrc" / "kernels"))
import generate_kernels  # noqa: E402

LOOPS = ("plain", "common_controls", "all_controls", "top_candidates")
COLUMNS = (*range(1, 300), 383, 384, 385, 511, 512, 513, 1000, 1024, 4096)
UNITS = {unit.filename.removesuffix(".cu") for unit in generate_kernels.kernels()}


def choice(arch, loop, columns, bf16=True, column_clusters=True, top_candidates_epilogue_warpgroups=True,
           plain_loop_extras=False, narrow_ragged_columns=True, tile_winners=False):
    return torch.ops.flashsampling._kernel_choice(arch, loop, columns, bf16, column_clusters,
                                                  top_candidates_epilogue_warpgroups, plain_loop_extras,
                                                  narrow_ragged_columns, tile_winners)


def test_every_choice_is_a_generated_unit_and_every_unit_is_chosen():
    chosen = set()
    for arch in (90, 100):
        for loop in LOOPS:
            for columns in COLUMNS:
                for bf16 in (True, False):
                    for clusters in (True, False):
                        for top_ewg in (True, False):
                            for narrow in (True, False):
                                chosen.add(choice(arch, loop, columns, bf16, clusters, top_ewg,
                                                  narrow_ragged_columns=narrow, tile_winners=not narrow))
    assert chosen <= UNITS, f"chosen but not generated: {sorted(chosen - UNITS)}"
    assert UNITS <= chosen, f"generated but never chosen: {sorted(UNITS - chosen)}"


@pytest.mark.parametrize("columns,unit", [
    (1, "n16_plain_pingpong"), (16, "n16_plain_pingpong"), (17, "n32_plain_pingpong_cluster_m2"),
    (32, "n32_plain_pingpong_cluster_m2"), (33, "n64_plain_epilogue_warpgroups"), (64, "n64_plain_epilogue_warpgroups"),
    (65, "n128_plain_epilogue_warpgroups"), (128, "n128_plain_epilogue_warpgroups"),
    (129, "n64_plain_epilogue_warpgroups"), (192, "n64_plain_epilogue_warpgroups"),
    (193, "n128_plain_epilogue_warpgroups_cluster_n2"), (256, "n128_plain_epilogue_warpgroups_cluster_n2"),
    (257, "n128_plain_epilogue_warpgroups"),  # three column tiles: no pairs
    (320, "n128_plain_epilogue_warpgroups"), (576, "n128_plain_epilogue_warpgroups"),
])
def test_plain_table_sm90(columns, unit):
    assert choice(90, "plain", columns) == f"sampler_bf16_{unit}_sm90"


def test_plain_passes_of_129_to_192_columns_take_narrow_tiles():
    """Plain passes of 129-192 columns run three 64-wide column tiles instead of two 128-wide
    ones, the second at most half full; narrow_ragged_columns = false keeps the 128-wide tiles (the
    A/B). Other loops, more columns and sm100 keep the 128-wide tiles."""
    for columns in (129, 144, 160, 192):
        assert choice(90, "plain", columns) == "sampler_bf16_n64_plain_epilogue_warpgroups_sm90", columns
        # the scale / soft-cap or penalties alone, and several samples alone: the plain loop's choice
        assert choice(90, "common_controls", columns, plain_loop_extras=True) == choice(90, "plain", columns)
        assert choice(90, loop(num_samples=2), columns, plain_loop_extras=True) == choice(90, "plain", columns)
        assert "_n128_" in choice(90, "plain", columns, narrow_ragged_columns=False), columns
        for other in ("common_controls", "all_controls", "top_candidates"):
            assert "_n128_" in choice(90, other, columns), (other, columns)
        assert choice(100, "plain", columns) == "sampler_bf16_n128_plain_sm100"
    for columns in (65, 128, 193, 256, 320, 576):
        assert "_n64_" not in choice(90, "plain", columns), columns


def test_controls_sm90():
    # up to 16 columns the CUTLASS pingpong tile; beyond, the epilogue-warpgroup kernels, which
    # also take the calls needing every control
    assert choice(90, "common_controls", 16) == "sampler_bf16_n16_common_controls_pingpong_sm90"
    assert choice(90, "all_controls", 16) == "sampler_bf16_n16_all_controls_pingpong_sm90"
    for loop in ("common_controls", "all_controls"):
        assert choice(90, loop, 17) == "sampler_bf16_n32_common_controls_epilogue_warpgroups_sm90"
        assert choice(90, loop, 50) == "sampler_bf16_n64_common_controls_epilogue_warpgroups_sm90"
        assert choice(90, loop, 200) == "sampler_bf16_n128_common_controls_epilogue_warpgroups_cluster_n2_sm90"
        assert choice(90, loop, 200, column_clusters=False) == "sampler_bf16_n128_common_controls_epilogue_warpgroups_sm90"


def test_top_candidates_and_sm100():
    assert [choice(90, "top_candidates", c) for c in (32, 33, 65, 128, 129, 256, 257)] == [
        "sampler_bf16_n16_top_candidates_pingpong_sm90", "sampler_bf16_n64_top_candidates_epilogue_warpgroups_sm90",
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_sm90",
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_sm90",
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_cluster_n2_sm90",
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_cluster_n2_sm90",
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_sm90"]  # three column tiles: no pairs
    assert choice(90, "top_candidates", 200, column_clusters=False) == (
        "sampler_bf16_n128_top_candidates_epilogue_warpgroups_sm90")
    # where asked (the A/B), CUTLASS's tiles: the 16-wide as by default, the 64-wide pingpong at 33-64
    # columns, the cooperative beyond
    assert [choice(90, "top_candidates", c, top_candidates_epilogue_warpgroups=False) for c in (32, 64, 65, 256)] == [
        "sampler_bf16_n16_top_candidates_pingpong_sm90", "sampler_bf16_n64_top_candidates_pingpong_cluster_m2_sm90",
        "sampler_bf16_n128_top_candidates_cooperative_sm90", "sampler_bf16_n128_top_candidates_cooperative_sm90"]
    assert choice(100, "top_candidates", 200, top_candidates_epilogue_warpgroups=False) == (
        choice(100, "top_candidates", 200)) == "sampler_bf16_n128_top_candidates_sm100"
    assert [choice(100, "plain", c, bf16=False) for c in (16, 32, 64, 500)] == [
        f"sampler_fp16_n{n}_plain_sm100" for n in (16, 32, 64, 128)]
    assert [choice(100, "all_controls", c) for c in (32, 33, 500)] == [
        "sampler_bf16_n16_all_controls_sm100", "sampler_bf16_n32_all_controls_sm100",
        "sampler_bf16_n32_all_controls_sm100"]


def test_other_architectures_have_no_kernel():
    assert choice(80, "plain", 4) == "" and choice(120, "plain", 4) == ""


def test_plain_loop_extras():
    """What the plain epilogue-warpgroup loop takes beside plain sampling (sampler_loop.h's
    needs_only_plain_loop_extras): the scale / soft-cap and / or the penalties alone, or several
    samples alone of a batch of B % 4 == 0 rows; never with another control, per-row keys or each
    other, never plain sampling itself."""
    extras = torch.ops.flashsampling._plain_loop_extras
    assert extras(model_transform=True) and extras(penalties=True) and extras(model_transform=True, penalties=True)
    assert extras(num_samples=5, batch_size=8) and extras(num_samples=2, batch_size=64)
    assert not extras() and not extras(batch_size=8)
    assert not extras(num_samples=5, batch_size=6)  # columns past a row quad: keyed noise
    assert not extras(num_samples=5, batch_size=8, per_row_keys=True)
    assert not extras(num_samples=5, batch_size=8, model_transform=True)
    assert not extras(num_samples=5, batch_size=8, per_row_temperatures=True)
    assert not extras(penalties=True, allowed_mask=True) and not extras(model_transform=True, logprobs=True)


@pytest.mark.parametrize("columns", [17, 32, 33, 64, 65, 128, 320, 1000])
def test_several_samples_alone_run_the_plain_kernel_beyond_32_columns(columns):
    """Several samples alone on row quads (speculative verification's positions) run the plain
    epilogue-warpgroup kernel beyond 32 columns on sm90; otherwise the loop for all controls'
    kernels."""
    unit = choice(90, loop(num_samples=2), columns, plain_loop_extras=True)
    assert ("_plain_" if columns > 32 else "_common_controls_") in unit and unit in UNITS, unit
    assert "_plain_" not in choice(90, loop(num_samples=2), columns)
    assert "_all_controls_" in choice(100, loop(num_samples=2), columns, plain_loop_extras=True)


def test_top_candidates_of_33_to_64_columns_keep_the_pingpong_tile_for_tile_winners():
    """A top-k pass of 33-64 columns runs the epilogue-warpgroup kernel's 64-wide scan unless it
    draws the tile winners (only the CUTLASS schedules' scan draws them): then the 64-wide
    pingpong tile, as with top_candidates_epilogue_warpgroups = false. Up to 32 and beyond 64
    columns, and on sm100, the tile winners change nothing."""
    for columns in (33, 48, 64):
        assert choice(90, "top_candidates", columns) == "sampler_bf16_n64_top_candidates_epilogue_warpgroups_sm90"
        assert choice(90, "top_candidates", columns, tile_winners=True) == \
            choice(90, "top_candidates", columns, top_candidates_epilogue_warpgroups=False) == \
            "sampler_bf16_n64_top_candidates_pingpong_cluster_m2_sm90"
    for columns in (1, 32, 65, 128, 256):
        assert choice(90, "top_candidates", columns, tile_winners=True) == choice(90, "top_candidates", columns)
    assert choice(100, "top_candidates", 50, tile_winners=True) == choice(100, "top_candidates", 50) == \
        "sampler_bf16_n64_top_candidates_sm100"


def test_bad_arguments_name_themselves():
    with pytest.raises(RuntimeError, match="loop must be"):
        choice(90, "plain_loop", 4)
    with pytest.raises(RuntimeError, match="columns must be"):
        choice(90, "plain", 0)


def loop(**needs):
    return torch.ops.flashsampling._sampler_loop(**needs)


def test_loop_of_a_call():
    """The loop a call needs (sampler_loop.h): plain only without any control; logit_scale /
    logit_softcap or the penalties alone take the common controls' loop, never the plain one; with per-row keys,
    sparse bias or several samples, the loop for all controls."""
    assert loop() == "plain"
    for need in ("model_transform", "penalties", "per_row_temperatures", "logit_bias", "allowed_mask", "logprobs"):
        assert loop(**{need: True}) == "common_controls", need
        assert loop(**{need: True}, sparse_bias=True) == "all_controls", need
        assert loop(**{need: True}, per_row_keys=True) == "all_controls", need
        assert loop(**{need: True}, num_samples=3) == "all_controls", need
    assert loop(model_transform=True, per_row_temperatures=True, logit_bias=True, allowed_mask=True,
                logprobs=True) == "common_controls"
    with pytest.raises(RuntimeError, match="num_samples"):
        loop(num_samples=0)


@pytest.mark.parametrize("columns", [1, 16, 17, 50, 100, 200, 300])
def test_penalised_calls_run_the_controls_kernels(columns):
    """A call with penalties and nothing else runs the common controls' kernels on every tile
    config (the epilogue-warpgroup kernels beyond 16 columns on sm90); with sparse bias or
    per-row keys, the loop for all controls."""
    needs = loop(penalties=True)
    for arch in (90, 100):
        unit = choice(arch, needs, columns)
        assert "_common_controls_" in unit and unit in UNITS, unit
    assert ("epilogue_warpgroups" in choice(90, needs, columns)) == (columns > 16)
    assert loop(penalties=True, sparse_bias=True) == "all_controls"


@pytest.mark.parametrize("columns", [1, 16, 17, 32, 33, 50, 64, 65, 100, 200, 300])
@pytest.mark.parametrize("needs", [dict(model_transform=True), dict(penalties=True),
                                   dict(model_transform=True, penalties=True)], ids=lambda n: "+".join(n))
def test_logit_transform_calls_run_the_controls_kernels_up_to_32_columns(columns, needs):
    """A soft-capped (or scaled) and / or penalised call with nothing else (plain_loop_extras) runs the common
    controls' kernels up to 32 columns (the CUTLASS pingpong tile up to 16 on sm90, the
    epilogue-warpgroup kernel beyond) and on sm100 (the visitor's); beyond 32 columns on sm90 the
    plain epilogue-warpgroup kernel (64 wide up to 64 columns), whose loop applies them. With
    another control beside them, the controls' kernels."""
    needs = loop(**needs)
    for arch in (90, 100):
        unit = choice(arch, needs, columns, plain_loop_extras=True)
        plain = arch == 90 and columns > 32
        assert ("_plain_" if plain else "_common_controls_") in unit and unit in UNITS, unit
        assert "_common_controls_" in choice(arch, needs, columns), columns
    assert ("epilogue_warpgroups" in choice(90, needs, columns, plain_loop_extras=True)) == (columns > 16)
