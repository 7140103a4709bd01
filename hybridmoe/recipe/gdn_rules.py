"""The validator's Gated DeltaNet rules: sequence-sharded context parallelism (mesh.context > 1), its
scan keys, and the Pallas GDN core's backend (registered in recipe/rules.py, run by recipe/validate.py)."""

from __future__ import annotations

from hybridmoe.config.errors import Problem
from hybridmoe.config.schema import Config
from hybridmoe.kernels.gdn import limits as gdn_limits
from hybridmoe.kernels.platform import PALLAS_PLATFORMS
from hybridmoe.recipe.facts import Facts, _context_size, _run_platform
from hybridmoe.recipe.rules import rule


@rule("gdn.chunk_size", "gdn.cp_m_scan", "gdn.cp_dh_scan", "mesh.context")
def _gdn_context_parallel(cfg: Config, f: Facts) -> list[Problem]:
    has_gdn = "gdn" in cfg.model.layer_pattern
    ranks = _context_size(cfg, f)
    chunk = cfg.gdn.chunk_size
    out = []
    if has_gdn and ranks and ranks > 1 and cfg.train.seq_len % (ranks * chunk):
        out.append(("gdn.chunk_size", f"sequence-sharded GDN needs whole chunks on every context rank: "
                    f"train.seq_len={cfg.train.seq_len} is not a multiple of mesh.context={ranks} x "
                    f"gdn.chunk_size={chunk}"))
    for key in ("cp_m_scan", "cp_dh_scan"):
        if not getattr(cfg.gdn, key):
            continue
        unmet = []
        if not has_gdn:
            unmet.append("needs GDN layers (model.layer_pattern has none)")
        if ranks is not None and ranks <= 1:
            unmet.append("needs sequence-sharded GDN context parallelism (mesh.context > 1)")
        if chunk != gdn_limits.CP_SCAN_CHUNK_SIZE:
            unmet.append(f"needs gdn.chunk_size={gdn_limits.CP_SCAN_CHUNK_SIZE} (got {chunk})")
        if unmet:
            out.append((f"gdn.{key}", "; ".join(unmet)))
    return out


def _gdn_pallas_gpu_dims(cfg: Config) -> list[str]:
    dims = {"gdn.chunk_size": cfg.gdn.chunk_size, "model.gdn_key_dim": cfg.model.gdn_key_dim,
            "model.gdn_value_dim": cfg.model.gdn_value_dim}
    return [f"needs {key} a power of two >= {gdn_limits.PALLAS_GPU_MIN_DIM} on GPU (got {n})" for key, n in dims.items()
            if n < gdn_limits.PALLAS_GPU_MIN_DIM or n & (n - 1)]


def _gdn_backend(cfg: Config, f: Facts) -> str:
    """kernels.gdn.backend with `auto` resolved for the platform the program is for."""
    return gdn_limits.resolve(cfg.kernels.gdn.backend, _run_platform(cfg, f), cfg.gdn.chunk_size)


@rule("kernels.gdn.backend", "gdn.chunk_size", "model.gdn_key_dim", "model.gdn_value_dim")
def _kernels_gdn_backend(cfg: Config, f: Facts) -> list[Problem]:
    """The Pallas GDN core: a platform that runs it, and the sizes its compiler accepts there."""
    backend = _gdn_backend(cfg, f)
    if backend == "xla" or cfg.kernels.interpret:
        return []
    unmet = []
    platform = _run_platform(cfg, f)
    if platform not in PALLAS_PLATFORMS[backend]:
        unmet.append(f"{backend} cannot run on this platform ({platform}); use xla, or kernels.interpret=true "
                     "to run the Pallas kernel interpreted")
    if backend == "pallas_tpu" and cfg.gdn.chunk_size < gdn_limits.PALLAS_TPU_MIN_CHUNK:
        unmet.append(f"needs gdn.chunk_size >= {gdn_limits.PALLAS_TPU_MIN_CHUNK} on TPU (got {cfg.gdn.chunk_size}; "
                     "Mosaic refuses the chunk-1 kernel)")
    if backend == "pallas_gpu":
        unmet += _gdn_pallas_gpu_dims(cfg)
    return [("kernels.gdn.backend", "; ".join(unmet))] if unmet else []


@rule("kernels.gdn.precision", "kernels.gdn.backend")
def _kernels_gdn_precision(cfg: Config, f: Facts) -> list[Problem]:
    """A precision other than auto is the Mosaic core's (on the whole sequence and under context
    parallelism alike): named where another core would drop it without a word."""
    precision = cfg.kernels.gdn.precision
    if precision == "auto" or "gdn" not in cfg.model.layer_pattern:
        return []
    if (backend := _gdn_backend(cfg, f)) != "pallas_tpu":
        return [("kernels.gdn.precision", f"sets the Mosaic GDN core's products; kernels.gdn.backend is {backend} "
                 "here (set kernels.gdn.backend=pallas_tpu, or precision auto)")]
    return []


@rule("kernels.gdn.layout", "kernels.gdn.backend", "gdn.cp_terms_in_kernel", "model.gdn_key_dim",
      "model.gdn_value_dim", "mesh.context")
def _kernels_gdn_layout(cfg: Config, f: Facts) -> list[Problem]:
    """Token-major blocks are the Mosaic core's, on the whole sequence or on the grouped
    context-parallel core, and on a chip each block is a key head's columns: lane-aligned widths."""
    if cfg.kernels.gdn.layout == "head_major" or "gdn" not in cfg.model.layer_pattern:
        return []
    unmet = []
    if (backend := _gdn_backend(cfg, f)) != "pallas_tpu":
        unmet.append(f"sets the Mosaic GDN core's blocks; kernels.gdn.backend is {backend} here (set "
                     "kernels.gdn.backend=pallas_tpu, or layout head_major)")
    ranks = _context_size(cfg, f)
    if ranks is not None and ranks > 1 and not cfg.gdn.cp_terms_in_kernel:
        unmet.append("under context parallelism needs gdn.cp_terms_in_kernel=true (the grouped core's kernels)")
    m = cfg.model
    group = m.gdn_num_value_heads // m.gdn_num_key_heads
    if why := gdn_limits.token_major_blocks_fit(m.gdn_num_key_heads, group, m.gdn_key_dim, m.gdn_value_dim,
                                                cfg.kernels.interpret):
        unmet.append(f"needs lane-aligned columns per key head on a TPU: {why} (model.gdn_key_dim, "
                     "model.gdn_value_dim)")
    return [("kernels.gdn.layout", "; ".join(unmet))] if unmet else []


@rule("gdn.cp_terms_in_kernel", "gdn.cp_m_scan", "gdn.cp_dh_scan", "kernels.gdn.backend", "mesh.context")
def _gdn_cp_terms_in_kernel(cfg: Config, f: Facts) -> list[Problem]:
    """The Mosaic core's own context-parallel kernels: sequence-sharded GDN on the pallas_tpu core, and
    neither scan key set beside it (its kernels walk the chunks themselves: the keys would do nothing)."""
    if not cfg.gdn.cp_terms_in_kernel:
        return []
    unmet = []
    if "gdn" not in cfg.model.layer_pattern:
        unmet.append("needs GDN layers (model.layer_pattern has none)")
    ranks = _context_size(cfg, f)
    if ranks is not None and ranks <= 1:
        unmet.append("needs sequence-sharded GDN context parallelism (mesh.context > 1)")
    if (backend := _gdn_backend(cfg, f)) != "pallas_tpu":
        unmet.append(f"runs on the Mosaic GDN core; kernels.gdn.backend is {backend} here (set "
                     "kernels.gdn.backend=pallas_tpu, with kernels.interpret=true off a TPU)")
    for key in ("cp_m_scan", "cp_dh_scan"):
        if getattr(cfg.gdn, key):
            unmet.append(f"leaves gdn.{key} nothing to do (its kernels walk the chunks themselves): set it false")
    return [("gdn.cp_terms_in_kernel", "; ".join(unmet))] if unmet else []
