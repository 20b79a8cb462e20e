"""`dflash export`: write a `dflash train` checkpoint in the served DFlash format
(checkpoint/export.py); its arguments are checked before torch loads."""
from __future__ import annotations

import shlex


def add_parser(sub) -> None:
    x = sub.add_parser("export", help="write a checkpoint in the DFlash format SGLang, vLLM and the reference read")
    x.add_argument("--checkpoint", required=True, help="RUN/checkpoint from dflash train")
    x.add_argument("--out", required=True, help="the directory to write (config.json, model.safetensors, README.md)")
    x.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    x.add_argument("--without-copy-head", action="store_true",
                   help="export a drafter that has a copy head without it (the format cannot carry one)")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier dflash export in --out (never a drafter dflash did not write)")
    from ..phases import add_telemetry_flag
    add_telemetry_flag(x)


def run(a) -> int:
    from .. import phases
    from ..checkpoint.export import check_request

    with phases.phase("check_inputs"):  # before torch; in the trace once it starts (dflash/phases.py)
        phases.check_telemetry_dir(a.telemetry_dir)
        check_request(a.checkpoint, a.out, without_copy_head=a.without_copy_head, overwrite=a.overwrite)
    phases.start("export", file_dir=a.telemetry_dir, argv=a.argv)
    from ..checkpoint.export import export_checkpoint  # (torch: imported inside the export phase)
    with phases.phase("export", checkpoint=a.checkpoint, out=a.out, dtype=a.dtype):
        res = export_checkpoint(a.checkpoint, a.out, dtype=a.dtype, without_copy_head=a.without_copy_head,
                                overwrite=a.overwrite)
    print(f"exported {a.checkpoint} -> {res['out']} ({res['dtype']}, {res['bytes'] / 1e6:.2f} MB of weights)")
    if res["without_copy_head"]:
        tau = res["tau_no_copy_estimate"]
        print("without its copy head: " + (f"held-out acceptance estimate tau {tau:.3f} (from training)"
                                           if tau is not None else "tau not measured")
              + f"; measure it: dflash eval --checkpoint {shlex.quote(a.checkpoint)} --no-copy-head")
    print(f"serve it: see {res['out']}/README.md (vLLM num_speculative_tokens = {res['block_size'] - 1})")
    return 0
