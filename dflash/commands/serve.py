"""`dflash serve EXPORT --target T`: vLLM's OpenAI-compatible server on 127.0.0.1 with the
export as its DFlash drafter (dflash/engine/serve.py). Checked first, before vLLM starts: the
flags, the port, the target, the engine's venv, and that the export fits the target."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a target with an exported drafter through vLLM (127.0.0.1 only)")
    s.add_argument("export", help="a drafter dir in the served format (dflash export / RUN/export)")
    s.add_argument("--target", required=True, help="the model it drafts for: smollm2, tiny-*, a model dir or hub id")
    s.add_argument("--target-seed", type=int, default=0, help="tiny targets: the seed they were built with")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--k", type=int, help="tokens drafted per verify step (default block_size - 1)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--otlp", metavar="ENDPOINT",
                   help="send vLLM's request traces here (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / "
                        "OTEL_EXPORTER_OTLP_ENDPOINT if set)")
    s.add_argument("--log", metavar="FILE", help="vLLM's own log (default: a temp file, named on start)")
    s.add_argument("--ready-timeout", type=float, default=900.0, metavar="SECONDS")


def run(a) -> int:
    from ..engine import runner
    from ..engine.serve import check_port, serve
    from ..errors import ConfigError
    from ..preflight.inputs import check_target_spec

    if a.k is not None and not 1 <= a.k <= 64:
        raise ConfigError(f"--k={a.k}: expected an integer in 1..64")
    if not 16 <= a.max_model_len <= 1 << 20:
        raise ConfigError(f"--max-model-len={a.max_model_len}: expected an integer in 16..1048576")
    check_port(a.port)
    check_target_spec(a.target, probe_hub=True)
    runner.engine_python()
    have = check_drafter(a.export, a.target)
    a.phase = "serve"
    try:  # Ctrl-C and SIGTERM (cli.main makes it one) stop the server's whole process tree: 130
        return serve(export=a.export, target_spec=a.target, target_seed=a.target_seed, port=a.port,
                     k=a.k or have["block_size"] - 1,
                     dtype=a.dtype, max_model_len=a.max_model_len, otlp=a.otlp, log=a.log,
                     ready_timeout_s=a.ready_timeout)
    except KeyboardInterrupt:
        print("dflash serve: interrupted; the server is stopped", file=sys.stderr)
        return 130
    except runner.EngineFailed as e:
        print(f"dflash serve: error: {e}", file=sys.stderr)
        return 1


def check_drafter(export: str, target: str) -> dict:
    """The export's DrafterConfig fields, checked against the target's config; its weights are
    read once, in bounded memory, for what vLLM would only trip over once serving (NaN or Inf
    values, a d2t past the target's vocabulary: drafter_dirs.inspect), never loaded."""
    from ..checkpoint import drafter_dirs
    from ..checkpoint import export_format as fmt
    from ..checkpoint.export import target_config
    from ..errors import ConfigError

    d = drafter_dirs.inspect(export)
    if d.kind != "export":
        raise ConfigError(f"{export}: a dflash training checkpoint, not the served format; export it first: "
                          f"dflash export --checkpoint {export} --out EXPORT_DIR")
    have = drafter_dirs.fields(d)
    tc = target_config(target).get_text_config()
    err = fmt.fit_error(have, hidden_size=tc.hidden_size, num_layers=tc.num_hidden_layers,
                        embed_rows=tc.vocab_size, where=export, draft_token_max=d.draft_token_max)
    if err:
        raise ConfigError(err)
    return have
