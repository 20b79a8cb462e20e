"""`dflash serve EXPORT --target T`: vLLM's OpenAI-compatible server on 127.0.0.1 with the
export as its DFlash drafter (dflash/engine/serve.py). Checked first, before vLLM starts (one
line, exit 2): the flags (--ready-timeout finite and > 0, --target-seed in range, the OTLP
endpoint parsed), the port, the --log file (as given, never through a link), the target, the
cache dir, the engine's venv, that the export fits the target and that the engine can serve
it, and --max-model-len within the target's positions (unset: 2048, or fewer if the target
has fewer)."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a target with an exported drafter through vLLM (127.0.0.1 only)")
    s.add_argument("export", help="a drafter dir in the served format (dflash export / RUN/export)")
    s.add_argument("--target", required=True, help="the model it drafts for: smollm2, tiny-*, a model dir or hub id")
    s.add_argument("--target-seed", type=int, default=0, help="tiny targets: the seed they were built with")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--k", help="tokens drafted per verify step (default block_size - 1); auto: the k the engine's "
                               "verdict measured fastest for this export on this kind of machine (serving_k.json)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    s.add_argument("--max-model-len", type=int,
                   help="the longest prompt + reply served (default: 2048, or the target's positions if fewer)")
    s.add_argument("--otlp", metavar="ENDPOINT",
                   help="send vLLM's request traces here (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / "
                        "OTEL_EXPORTER_OTLP_ENDPOINT if set)")
    s.add_argument("--log", metavar="FILE", help="vLLM's own log (default: a temp file, named on start)")
    s.add_argument("--ready-timeout", type=float, default=900.0, metavar="SECONDS")
    from ..phases import add_telemetry_flag
    add_telemetry_flag(s)


def run(a) -> int:
    from .. import phases

    with phases.phase("check_inputs"):  # in the trace once it starts (dflash/phases.py)
        _check(a)
    phases.start("serve", file_dir=a.telemetry_dir, argv=a.argv)
    from ..engine import runner
    from ..engine.serve import serve
    a.phase = "serve"
    try:  # Ctrl-C and SIGTERM (cli.main makes it one) stop the server's whole process tree: 130
        return serve(export=a.export, target_spec=a.target, target_seed=a.target_seed, port=a.port,
                     k=a.k or a.have["block_size"] - 1,
                     dtype=a.dtype, max_model_len=a.max_model_len, otlp=a.otlp, log=a.log,
                     ready_timeout_s=a.ready_timeout)
    except KeyboardInterrupt:
        print("dflash serve: interrupted; the server is stopped", file=sys.stderr)
        return 130
    except runner.EngineFailed as e:
        print(f"dflash serve: error: {e}", file=sys.stderr)
        return 1


def _check(a) -> None:
    """Every flag, the port, the target, the export: one line (exit 2) before vLLM starts."""
    import math

    from .. import phases
    from ..config import MAX_SEED
    from ..engine import runner
    from ..engine.serve import check_log, check_otlp, check_port
    from ..engine.targets import check_engine_target
    from ..errors import ConfigError
    from ..preflight.inputs import check_cache_dir, check_target_spec

    auto = a.k == "auto"
    if a.k is not None and not auto:
        try:
            a.k = int(a.k)
        except ValueError:
            raise ConfigError(f"--k={a.k!r}: expected an integer in 1..64, or auto") from None
        if not 1 <= a.k <= 64:
            raise ConfigError(f"--k={a.k}: expected an integer in 1..64")
    if a.max_model_len is not None and not 16 <= a.max_model_len <= 1 << 20:
        raise ConfigError(f"--max-model-len={a.max_model_len}: expected an integer in 16..1048576")
    if not (math.isfinite(a.ready_timeout) and a.ready_timeout > 0):  # nan would never time out
        raise ConfigError(f"--ready-timeout={a.ready_timeout}: expected a finite number of seconds > 0")
    if not 0 <= a.target_seed <= MAX_SEED:  # as model.target_seed: what torch.manual_seed takes
        raise ConfigError(f"--target-seed={a.target_seed}: expected an integer >= 0 and <= {MAX_SEED}")
    check_otlp(a.otlp)
    phases.check_telemetry_dir(a.telemetry_dir)
    check_port(a.port)
    check_log(a.log)
    check_target_spec(a.target, probe_hub=True)
    check_cache_dir()
    check_engine_target(a.target, a.target_seed)
    runner.engine_python()
    have, positions = check_drafter(a.export, a.target, a.k)
    a.k = have.get("served_k", a.k)  # --k auto: the export's measured k
    a.max_model_len = check_max_model_len(a.max_model_len, positions)
    a.have = have


def auto_k(export: str, block_size: int) -> int:
    """`--k auto`: the k recorded in the export by the engine's verdict (engine/kchoice.py),
    said on stderr with where it was measured; measured on another kind of CPU, said too."""
    from ..engine import kchoice, machine

    k, rec = kchoice.serve_k(export, block_size)
    where = rec.get("machine")  # hand-edited, it may hold anything: machine.py reads only well-typed fields
    date = "".join(c if c.isprintable() else "?" for c in str(rec.get("date", "?")))[:40]
    print(f"dflash serve: --k auto: k={k} (measured {date} on {machine.describe(where)})", file=sys.stderr)
    here = machine.host()
    if "unknown kernels" not in (machine.kind(where), machine.kind(here)) and machine.kind(where) != machine.kind(here):
        print(f"dflash serve: notice: k was measured with vLLM's {machine.kind(where)} kernels, this machine runs its "
              f"{machine.kind(here)} ones: the fastest k may differ here (measure it: dflash eval --engine vllm)",
              file=sys.stderr)
    return k


def check_drafter(export: str, target: str, k: int | str | None = None) -> tuple[dict, int | None]:
    """The export's DrafterConfig fields, checked against the target's config and against what
    the engine can serve (``k``: within its block; "auto": the export's measured k, as
    ``served_k`` in the fields returned); its weights are read once, in bounded memory, for what vLLM would only
    trip over once serving (NaN or Inf values, a d2t past the target's vocabulary:
    drafter_dirs.inspect), never loaded; and the target's positions (None: unknown)."""
    import shlex

    from ..checkpoint import drafter_dirs
    from ..checkpoint import export_format as fmt
    from ..checkpoint.export import target_config
    from ..engine.machine import isa_env
    from ..engine.runner import k_error, unservable
    from ..errors import ConfigError

    d = drafter_dirs.inspect(export, flag="export")  # serve has no --checkpoint: its messages say "export"
    if d.kind != "export":
        raise ConfigError(f"{export}: a dflash training checkpoint, not the served format; export it first: "
                          f"dflash export --checkpoint {shlex.quote(export)} --out EXPORT_DIR")
    have = drafter_dirs.fields(d)
    isa_env()  # a bad DFLASH_VLLM_ISA: one line, before any engine starts
    err = unservable(have, export)  # from its config alone: before the target's config is read
    if not err and k == "auto":
        k = have["served_k"] = auto_k(export, have["block_size"])
    if not err and k is not None:
        err = k_error([k], have, "--k", export)
    if err:
        raise ConfigError(err)
    tc = target_config(target).get_text_config()
    err = fmt.fit_error(have, hidden_size=tc.hidden_size, num_layers=tc.num_hidden_layers,
                        embed_rows=tc.vocab_size, where=export, draft_token_max=d.draft_token_max)
    if err:
        raise ConfigError(err)
    return have, target_positions(tc)


DEFAULT_MAX_MODEL_LEN = 2048
# the keys vLLM reads a model's length from (the smallest wins: vllm/transformers_utils)
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                  "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def target_positions(tc) -> int | None:
    """The positions the target was built for, as vLLM derives them (the smallest of its
    keys), or None: none given, or a RoPE scaling that vLLM may stretch them by."""
    found = [v for v in (getattr(tc, k, None) for k in _POSITION_KEYS) if isinstance(v, int) and v > 0]
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    scaled = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) not in (None, "default")
    return min(found) if found and not scaled else None


def check_max_model_len(asked: int | None, positions: int | None) -> int:
    """--max-model-len within the target's positions (vLLM refuses more, but only once it has
    started); unset: 2048, or the target's positions when it has fewer."""
    from ..errors import ConfigError

    if asked is None:
        n = min(DEFAULT_MAX_MODEL_LEN, positions or DEFAULT_MAX_MODEL_LEN)
        if n < 16:
            raise ConfigError(f"the target has {positions} positions: too few to serve (16 at least)")
        return n
    if positions is not None and asked > positions:
        raise ConfigError(f"--max-model-len={asked}: the target has {positions} positions (its config's "
                          f"limit, which vLLM enforces once started); expected an integer in 16..{positions}")
    return asked
