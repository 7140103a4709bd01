"""benchmarks/gdn_static_profile.py: libtpu's static profile of the Mosaic GDN kernels, compiled for a
v5e target on this host, read per kernel."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gdn_static_profile as gsp  # noqa: E402


def _write(folder, name, op, cycles):
    (folder / f"{name}_static_llo_profile.textproto").write_text(
        f'hlo_op_estimate {{\n  hlo_op_name: "{op}"\n  estimated_cycles: {cycles}\n  num_equivalent_hlos: 1\n}}\n')


def test_the_profile_files_are_read_per_kernel_and_summed_over_calls(tmp_path):
    """Two calls of the forward kernel add up, autodiff's prefixes and suffixes are not part of the
    name; other ops are no kernel of the core; a file cut short (the abort) is skipped."""
    _write(tmp_path, "gdn_chunk_forward.1", "gdn_chunk_forward.1", 1000)
    _write(tmp_path, "jvp_gdn_chunk_forward_.2", "jvp_gdn_chunk_forward_.2", 500)
    _write(tmp_path, "transpose_jvp_gdn_chunk_backward__.1", "transpose_jvp_gdn_chunk_backward__.1", 2500)
    _write(tmp_path, "fusion.4", "fusion.4", 99)
    (tmp_path / "copy.6_static_llo_profile.textproto").write_text("")
    assert gsp.kernel_cycles(tmp_path) == {"gdn_chunk_forward": 1500, "gdn_chunk_backward": 2500}


@pytest.mark.slow  # two v5e compiles with the profile (about a minute each)
@pytest.mark.tpu_compile
def test_a_v5e_compile_profiles_both_kernels():
    """The forward alone and the backward out of a forward + backward compile each state cycles
    (the second compile's abort after the backward's file is tolerated)."""
    forward, backward = (gsp.profile("default", part, tokens=256) for part in gsp.PARTS)
    assert forward > 0 and backward > forward, (forward, backward)
