"""The ``input.json`` schema mdloader reads, written with dargs as DeePMD-kit writes its own.

Only the keys that concern data (plus the few the reference training job needs) are checked
for their values. DeePMD-kit's names, aliases and defaults are kept so that one ``input.json``
drives both ``dp --pt train`` and ``mdloader``. Every section mdloader reads is checked strictly,
as ``dp`` checks it: DeePMD-kit's other keys there are declared and passed through
(:data:`DEEPMD_KEYS`), so a complete DeePMD-kit input (descriptor, fitting net, ...) is accepted
as is, and a misspelt key (``training.sav_freq``) is refused with "did you mean" instead of
silently leaving the default in place.

The value checks are small predicates with a sentence saying what is expected; the sentence
serves both the error message and the generated reference (:func:`schema_markdown`), so the
docs cannot drift from the checker.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dargs import Argument


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _nonnegative_int(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def _check_batch_size(value: Any) -> bool:
    # String rules are checked by mdloader.sampling.batching.parse_rule (config.input_json).
    if isinstance(value, list):
        return len(value) > 0 and all(_positive_int(v) for v in value)
    return isinstance(value, str) or _positive_int(value)


def _check_sys_probs(value: Any) -> bool:
    if value is None:
        return True
    return len(value) > 0 and all(
        not isinstance(v, bool) and math.isfinite(float(v)) for v in value)


def _check_systems(value: Any) -> bool:
    items = [value] if isinstance(value, str) else value
    return len(items) > 0 and all(isinstance(s, str) and s.strip() for s in items)


def _check_type_map(value: Any) -> bool:
    return value is None or (len(value) > 0 and len(set(value)) == len(value)
                             and all(s.strip() for s in value))


def _nonnegative_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


_EXPECT_BATCH = ("a positive integer, a non-empty list of positive integers, or a rule "
                 "string 'auto', 'auto:N', 'max:N', 'filter:N' (N a positive integer)")



#: DeePMD-kit 3.2's keys (``deepmd.utils.argcheck.gen_args``, every variant) that mdloader does
#: not read, per section (dotted JSON path; "" is the top level): declared so that a complete
#: DeePMD-kit input passes while any other key is refused with "did you mean", as ``dp`` does.
#: Their values are DeePMD-kit's to check; ``tests/config/test_strict_keys.py`` compares these
#: lists with DeePMD-kit's.
DEEPMD_KEYS: dict[str, tuple[str, ...]] = {
    "": (
        "optimizer", "validating", "nvnmd",
    ),
    "model": (
        "atom_exclude_types", "bridging_method", "bridging_r_inner", "bridging_r_outer",
        "compress", "data_bias_nsample", "data_stat_protect", "descriptor", "enable_tf32",
        "finetune_head", "fitting_net", "info", "lora", "model_branch_alias", "model_file",
        "models", "modifier", "pair_exclude_types", "preset_out_bias", "qm_model", "qmmm_model",
        "rcut", "sel", "shared_dict", "smin_alpha", "spin", "srtab_add_bias", "sw_rmax", "sw_rmin",
        "tab_file", "type", "type_embedding", "use_compile", "use_srtab", "weights",
    ),
    "learning_rate": (
        "decay_phase_ratio", "decay_rate", "decay_type", "scale_by_worker", "smooth",
        "stop_lr_ratio", "warmup_ratio", "warmup_start_factor", "warmup_steps",
    ),
    "loss": (
        "beta", "dens_corrupt_ratio", "dens_denoising_pos_coefficient", "dens_fixed_noise_std",
        "dens_prob", "dens_std", "enable_atom_ener_coeff", "enable_atomic_weight", "f_use_norm",
        "huber_delta", "intensive_ener_virial", "limit_pref_acdf", "limit_pref_ados",
        "limit_pref_ae", "limit_pref_cdf", "limit_pref_dos", "limit_pref_fm", "limit_pref_fr",
        "limit_pref_gf", "limit_pref_h", "limit_pref_pf", "limit_pref_pop",
        "limit_pref_pop_alpha_total", "limit_pref_pop_beta_total", "limit_pref_spin",
        "limit_pref_spin_total", "limit_pref_v", "loss_func", "metric", "numb_generalized_coord",
        "pref", "pref_atomic", "relative_f", "start_pref_acdf", "start_pref_ados", "start_pref_ae",
        "start_pref_cdf", "start_pref_dos", "start_pref_fm", "start_pref_fr", "start_pref_gf",
        "start_pref_h", "start_pref_pf", "start_pref_pop", "start_pref_pop_alpha_total",
        "start_pref_pop_beta_total", "start_pref_spin", "start_pref_spin_total", "start_pref_v",
        "use_default_pf", "use_huber",
    ),
    # with the legacy keys ``dp`` still accepts here, then drops (numb_test) or moves to
    # learning_rate (warmup_*) or to optimizer (opt_type, kf_*, adam_*, ...): deepmd.utils.compat
    "training": (
        "acc_freq", "adam_beta1", "adam_beta2", "change_bias_after_training", "ckpt_keep_ratio",
        "disp_avg", "disp_training", "ema_ckpt_keep", "ema_decay", "enable_compile", "enable_ema",
        "enable_profiler", "enable_tf32", "gradient_max_norm", "kf_blocksize", "kf_limit_pref_e",
        "kf_limit_pref_f", "kf_start_pref_e", "kf_start_pref_f", "lr_adjust", "lr_adjust_coeff",
        "max_ckpt_keep", "min_2d_dim", "mixed_precision", "momentum", "muon_2d_only",
        "muon_momentum", "neighbor_graph_method", "numb_test", "opt_type", "profiling",
        "profiling_file", "save_dir", "stat_file", "stat_file_mode", "tensorboard",
        "tensorboard_freq", "tensorboard_log_dir", "time_training", "warmup_ratio",
        "warmup_start_factor", "warmup_steps", "weight_decay", "zero_stage",
    ),
}


def _passed_through(section: str) -> list[Argument]:
    """Optional arguments of any value for the DeePMD-kit keys of ``section`` mdloader ignores."""
    return [Argument(name, object, optional=True, default=None, doc=_PASSED)
            for name in DEEPMD_KEYS[section]]


_PASSED = "DeePMD-kit's; not read by mdloader (passed through)."


def _arg(name: str, dtype: Any, doc: str, *, optional: bool = True, default: Any = None,
         alias: list[str] | None = None, check: Callable[[Any], bool] | None = None,
         expect: str = "", sub: list[Argument] | None = None) -> Argument:
    """An :class:`Argument` whose ``extra_check_errmsg`` is the "expected" sentence."""
    kwargs: dict[str, Any] = {}
    if optional:
        kwargs["default"] = default
    return Argument(name, dtype, sub_fields=sub, optional=optional, alias=alias,
                    extra_check=check, extra_check_errmsg=expect, doc=doc, **kwargs)


def _data_args(validation: bool) -> list[Argument]:
    args = [
        _arg("systems", [list[str], str], "Data systems: directories holding `type.raw`, "
             "HDF5 files (`file.h5` or `file.h5#/group`), or folders searched recursively "
             "for them. Relative paths are taken from the folder of input.json.",
             optional=False, check=_check_systems,
             expect="a non-empty path or a non-empty list of non-empty paths"),
        _arg("rglob_patterns", [list[str], None], "Glob patterns matched recursively under "
             "each entry of `systems`; only matches holding `type.raw` are systems."),
        _arg("batch_size", [list[int], int, str], "Frames per batch: one integer for all "
             "systems, one per system, or a rule (`auto[:N]`: at least N atoms per batch, "
             "`max:N`: at most N atoms, `filter:N`: as `max:N` after dropping systems with "
             "more than N atoms, `mix:N`: on one LMDB database, frames of any atom count up "
             "to N atoms per batch, padded as DeePMD-kit 3.2 pads them).", default="auto",
             check=_check_batch_size, expect=_EXPECT_BATCH),
        _arg("auto_prob", str, "How often each system is drawn: `prob_uniform`, "
             "`prob_sys_size` (proportional to its number of batches), or "
             "`prob_sys_size;a:b:w;...` (block [a, b) gets weight w).",
             default="prob_sys_size", alias=["auto_prob_style"]),
        _arg("sys_probs", [list[float], None], "Probability of each system (same length "
             "as the system list); a negative entry shares the remaining mass by size. "
             "Takes priority over `auto_prob`.", alias=["sys_weights"],
             check=_check_sys_probs, expect="a non-empty list of finite numbers"),
        _arg("index_file", [str, None], "mdloader: the system index file of these systems (their "
             "descriptions, saved by rank 0 after a build and reused at the next start; see "
             "the HPC guide). Default: a file in `$MDLOADER_CACHE_DIR/index` named after the "
             "systems. A relative path is taken from the folder of input.json.",
             check=lambda v: v is None or bool(v.strip()), expect="a non-empty path or null"),
        _arg("set_prefix", str, "Deprecated by DeePMD-kit; only `set` is accepted.",
             default="set", check=lambda v: v == "set", expect="'set' (deprecated key)"),
    ]
    if validation:
        args.append(_arg("numb_btch", int, "Batches drawn for each validation.", default=1,
                         alias=["numb_batch"], check=_positive_int,
                         expect="a positive integer"))
    else:
        args.append(_arg("balance_window", int, "mdloader: balanced steps. The ranks deal the "
                         "batches their streams draw in each window of this many steps so that "
                         "every step's batches cost about the same on every rank (the same "
                         "batches and probabilities, the steps of a window shuffled); 0: off. "
                         "32 or more keeps the busiest rank within a few % of the mean.",
                         default=0, check=_nonnegative_int, expect="an integer >= 0"))
        args.append(_arg("balance_cost", str, "mdloader: the cost of a batch that balanced steps "
                         "even out: `atoms` (atoms per frame x batch size) or `neighbours` "
                         "(that x the mean neighbours within rcut; takes effect where neighbour "
                         "statistics are given, an error otherwise).", default="atoms",
                         check=lambda v: v in ("atoms", "neighbours"),
                         expect="'atoms' or 'neighbours'"))
        args.append(_arg("min_pair_dist", [float, int], "DeePMD-kit (PyTorch): frames with a "
                         "closer atom pair are left out of the loss. Accepted for "
                         "compatibility; the loader does not use it.", default=0.0,
                         check=_nonnegative_number, expect="a number >= 0"))
    return args


def training_data_arg() -> Argument:
    """``training.training_data``: checked strictly (mdloader owns every key in it)."""
    return Argument("training_data", dict, sub_fields=_data_args(False),
                    doc="Training data systems and how they are batched and sampled.")


def validation_data_arg() -> Argument:
    """``training.validation_data``: as training data, plus ``numb_btch``."""
    return Argument("validation_data", [dict, None], sub_fields=_data_args(True),
                    optional=True, default=None,
                    doc="Validation data systems; same keys as training_data plus numb_btch.")


def _training_arg() -> Argument:
    return Argument("training", dict, doc="Training options (other keys pass through).",
                    sub_fields=[
        training_data_arg(),
        validation_data_arg(),
        _arg("numb_steps", [int, None], "Number of training steps (one batch each). "
             "Mutually exclusive with numb_epoch. 0, as in DeePMD-kit, trains nothing: the "
             "statistics are computed and the untrained model is saved at step 0.",
             alias=["stop_batch", "num_step", "num_steps", "numb_step"],
             check=lambda v: v is None or _nonnegative_int(v), expect="an integer >= 0"),
        _arg("numb_epoch", [int, float, None], "Training length in expected passes over "
             "the training data: steps = ceil(numb_epoch * ceil(max_i nb_i / p_i)).",
             alias=["num_epochs", "num_epoch", "numb_epochs"],
             check=lambda v: v is None or _positive_number(v), expect="a positive number"),
        _arg("seed", [int, None], "Seed of the samplers (mixed with the rank).",
             check=lambda v: v is None or _is_int(v), expect="an integer or null"),
        _arg("disp_freq", int, "Steps between two lines of lcurve.out.", default=1000,
             check=_positive_int, expect="a positive integer"),
        _arg("save_freq", int, "Steps between two checkpoints.", default=1000,
             check=_positive_int, expect="a positive integer"),
        _arg("disp_file", str, "File of the learning curve.", default="lcurve.out"),
        _arg("save_ckpt", str, "Checkpoint file prefix.", default="model.ckpt"),
        *_passed_through("training"),
    ])


def _model_arg() -> Argument:
    return Argument("model", dict, optional=True, default={}, doc="Model (only type_map "
                    "and data_stat_nbatch are read; other keys pass through).", sub_fields=[
        _arg("type_map", [list[str], None], "Element names; index = model type id. Systems "
             "are remapped to it through their type_map.raw.", check=_check_type_map,
             expect="a non-empty list of distinct element names"),
        _arg("data_stat_nbatch", int, "Batches of each training system that the statistics "
             "before training read (DeePMD-kit's key). `mdloader train` fits its reference "
             "model's energy bias and feature scales on the first `data_stat_nbatch` batches "
             "of each system in a one-rank job's first pass under the job's seed, whatever "
             "the number of ranks.", default=10, check=_positive_int,
             expect="a positive integer"),
        *_passed_through("model"),
    ])


def _learning_rate_arg() -> Argument:
    return Argument("learning_rate", dict, optional=True, default={}, doc="Learning rate "
                    "of the reference training (DeePMD-kit's exponential decay).", sub_fields=[
        _arg("type", str, "Schedule; `mdloader train` implements `exp`.", default="exp"),
        _arg("start_lr", [float, int], "Learning rate at step 0.", default=1e-3,
             check=_positive_number, expect="a positive number"),
        _arg("stop_lr", [float, int], "Learning rate reached at the last step.",
             default=1e-8, check=_positive_number, expect="a positive number"),
        _arg("decay_steps", int, "Steps between two decays.", default=5000,
             check=_positive_int, expect="a positive integer"),
        *_passed_through("learning_rate"),
    ])


def _loss_arg() -> Argument:
    doc = "Prefactor of the {} loss at {} (interpolated with the learning rate)."
    specs = [("start_pref_e", 0.02, "energy", "the start"),
             ("limit_pref_e", 1.0, "energy", "the end"),
             ("start_pref_f", 1000.0, "force", "the start"),
             ("limit_pref_f", 1.0, "force", "the end")]
    return Argument("loss", dict, optional=True, default={}, doc="Loss of the reference "
                    "training (DeePMD-kit's `ener` loss, energy and force terms).", sub_fields=[
        _arg("type", str, "Loss type; `mdloader train` implements `ener`.", default="ener"),
        *[_arg(name, [float, int], doc.format(what, when), default=default,
               check=_nonnegative_number, expect="a number >= 0")
          for name, default, what, when in specs],
        *_passed_through("loss"),
    ])


def input_schema() -> Argument:
    """The whole ``input.json`` as mdloader reads it (root argument named ``input``)."""
    return Argument("input", dict, sub_fields=[
        _model_arg(), _learning_rate_arg(), _loss_arg(), _training_arg(), *_passed_through("")])




def _type_name(dtype: Any) -> str:
    if dtype is None or dtype is type(None):
        return "null"
    if getattr(dtype, "__origin__", None) is not None:
        return str(dtype)
    return dtype.__name__


def _rows(arg: Argument, prefix: str) -> list[str]:
    rows = []
    for sub in arg.sub_fields.values():
        if sub.doc == _PASSED:  # DeePMD-kit's own keys: its documentation describes them
            continue
        path = f"{prefix}.{sub.name}" if prefix else sub.name
        types = " \\| ".join(sorted(_type_name(t) for t in sub.dtype))
        if not sub.optional:
            default = "required"
        else:
            default = "—" if sub.default is None else f"`{sub.default!r}`"
        alias = ", ".join(f"`{a}`" for a in sub.alias) or "—"
        doc = sub.doc + (f" Expected: {sub.extra_check_errmsg}." if sub.extra_check_errmsg
                         else "")
        rows.append(f"| `{path}` | {types} | {default} | {alias} | {doc} |")
        rows.extend(_rows(sub, path))
    return rows


def schema_markdown() -> str:
    """Render the schema as a Markdown table for the docs' input.json reference.

    dargs' own ``Argument.gen_doc`` emits reStructuredText; a table generated from the same
    ``Argument`` objects keeps the Markdown docs in step with the checker.
    """
    head = ["| key | type | default | aliases | meaning |", "|---|---|---|---|---|"]
    note = ("Keys starting with `_` (`_comment`, ...) are dropped first, as DeePMD-kit does. "
            "Unknown keys are errors (with a \"did you mean\"), as in DeePMD-kit's strict "
            "check, at the top level and in `model`, `learning_rate`, `loss`, `training` and "
            "its data sections; DeePMD-kit 3.2's other keys of these sections (descriptor, "
            "fitting net, optimizer, ...) are accepted and passed through unread, and the "
            "sections mdloader does not read (`model.descriptor`, `optimizer`, `validating`, "
            "`nvnmd`, ...) unchecked, so a complete DeePMD-kit input.json is accepted. A "
            "multi-task input (`model.model_dict`, `training.data_dict`) is read per task: "
            "each task's data sections are checked as the sections above (see Multi-task "
            "training); `mdloader train` refuses it. Inputs for what mdloader does not serve "
            "are refused in one line naming the key: TensorFlow spin models "
            "(`model.spin.spin_norm`, `model.spin.virtual_len`) and the TensorFlow-only batch "
            "rule `mixed:N`.")
    return "\n".join(head + _rows(input_schema(), "")) + "\n\n" + note + "\n"
