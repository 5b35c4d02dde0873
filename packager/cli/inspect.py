"""edgeq inspect: print the manifest of a bundle directory or archive."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from edgeq.errors import BundleError


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="print a bundle's manifest", description="Print the manifest of a bundle directory or .tar.gz.")
    parser.add_argument("bundle", type=Path, help="bundle directory or .tar.gz archive")
    parser.add_argument("--json", action="store_true", help="print the whole manifest as JSON")


def _tensors(specs) -> str:
    return ", ".join(f"{t.name} {t.dtype} {'x'.join(map(str, t.shape))}" for t in specs)


def _cpu_kernels(info) -> str:
    if not info:
        return "-"
    schedules = ", ".join(f"{k} {v}" for k, v in info["schedules"].items())
    return f"{info['conv_matmul_calls']} conv/matmul calls on edgeq kernels; TIR functions by schedule: {schedules}"


def _gpu_kernels(info) -> str:
    from edgeq.backends.cuda.ledger import NOT_RUN

    if not info:
        return "-"
    rules = ", ".join(f"{k} {v}" for k, v in info.get("schedules", {}).items())
    text = f"{info.get('kernels_per_inference', '?')} kernels per inference; TIR functions by schedule rule: {rules or '-'}"
    if info.get("fallbacks"):
        text += (f"; {len(info['fallbacks'])} schedule(s) did not build and were replaced by the next that did "
                 "(library.gpu_kernels.fallbacks)")
    text += f"; CUDA graph: {'yes' if info.get('cuda_graph') else 'no'}"
    cutlass = info.get("cutlass")
    if cutlass is not None:  # --gpu-kernels cutlass: which convolutions it took, and why it left the others
        taken, left = len(cutlass.get("kernels", [])), cutlass.get("left", [])
        depthwise = len(cutlass.get("depthwise", []))
        pools = len(cutlass.get("pool_classifiers", []))
        excitations = len(cutlass.get("squeeze_excitations", []))
        scores = len(cutlass.get("attention_scores", []))
        total = taken + depthwise + pools + 2 * excitations + scores + len(left)
        text += f"; CUTLASS {cutlass.get('version', '?')}: {taken} of {total} convolutions and matrix products"
        split = sum(1 for k in cutlass.get("kernels", []) if k.get("split_k", 1) > 1)
        if split:
            text += f" ({split} with their K in slices: serial split-K)"
        if depthwise:
            text += f", {depthwise} depthwise on edgeq's kernel"
        if pools:
            text += f", {pools} batch-1 classifier(s) with the global pool before it in one kernel (edgeq's)"
        if excitations:
            text += (f"; {excitations} squeeze-and-excitation gate(s) with their product in one kernel each (edgeq's; "
                     f"{2 * excitations} one-pixel convolutions)")
        concats = cutlass.get("concatenations_in_place", [])
        if concats:
            pooled = sum(1 for c in concats if any("window" in part for part in c["parts"]))
            upsampled = sum(1 for c in concats if any("nearest_2x_of" in part for part in c["parts"]))
            text += (f"; {len(concats)} concatenation(s) written in place by the kernels of their parts (no "
                     "concatenation kernel" + (f"; {pooled} with its max pools in one kernel (edgeq's)" if pooled else "")
                     + (f"; {upsampled} with an upsampled part its convolution writes" if upsampled else "") + ")")
        heads = cutlass.get("detector_outputs", [])
        if heads:
            text += (f"; the detector's output written by its head's {sum(len(h['parts']) for h in heads)} last "
                     "convolutions (no transpose or concatenation kernel)")
        if scores:
            text += (f"; {scores} attention score product(s) with their softmax in one kernel each (edgeq's, CUDA "
                     "cores)")
        norms = len(cutlass.get("layer_norms", []))
        if norms:
            text += f"; {norms} layer norm(s) writing the next layer's fp16 or int8 input in the same kernel (edgeq's)"
        quantizes = len(cutlass.get("row_quantizes", []))
        if quantizes:
            text += f"; {quantizes} per-token quantize(s) with their row's scale in one kernel each (edgeq's)"
        if left:
            text += " (the rest on dlight: " + "; ".join(f"{x['conv']}: {x['why']}" for x in left[:5]) + \
                    (", ..." if len(left) > 5 else "") + ")"
        held = cutlass.get("held", [])
        if held:  # --gpu-kernels auto: kernels whose kinds no GPU has run as written today
            kinds = sorted({k for x in held for k in x["kinds"]})
            text += (f"; {len(held)} layer(s) held on dlight, {NOT_RUN} (kinds: {', '.join(kinds)}; "
                     "--gpu-kernels cutlass takes them anyway)")
    memory = info.get("memory")
    if memory and "total_bytes" in memory:  # the GPU memory the bundle takes on the device
        text += (f"; GPU memory {memory['total_bytes'] / 2**20:.1f} MB (weights {memory['weights_bytes'] / 2**20:.1f}, "
                 f"activations {memory['workspace_bytes'] / 2**20:.1f}, module globals {memory['globals_bytes']} bytes"
                 + (f"; the device has {memory['device_bytes'] / 2**20:.0f} MB" if memory.get("device_bytes") else "")
                 + ")")
    choice = info.get("choice")
    if choice:  # how layers were put on kernels: --gpu-kernels as asked, the ledger auto went by
        text += f"; --gpu-kernels {choice['gpu_kernels']}"
        ledger = choice.get("ledger")
        if ledger is not None:
            text += f" (GPU-verified kernel kinds: {len(ledger['verified'])} of {ledger['kinds']})"
        if choice.get("note"):
            text += f": {choice['note']}"
    return text


def _runtime(record, compatibility) -> str:
    if not record:
        return "none (packaged with --runtime none: the device brings apache-tvm)"
    sources = ", ".join(f"{s['project']} {s['version']}" + (f" ({s['wheel']})" if s.get("wheel") else " (installed)")
                        for s in record.sources)
    bridge = record.cuda_bridge
    text = (f"{len(record.libraries) + 1} files, {record.bytes / 1e6:.1f} MB: {', '.join(record.libraries)}, "
            f"{record.loader}; from {sources}")
    if bridge:
        text += f"; CUDA bridge {bridge['provides']} -> {bridge['forwards_to']} ({len(bridge['functions'])} functions)"
    if compatibility:
        needs = compatibility["needs"]
        text += f"; needs glibc {needs['glibc'] or '-'}, GLIBCXX {needs['glibcxx'] or '-'}"
    return text


def _reference_check(check) -> str:
    if check is None:
        return "- (made by an edgeq without the reference check)"
    text = (f"{check.result}: {check.checked} against {check.reference} on {check.graph}; "
            f"largest |diff| {check.max_abs_diff:.3g} (rtol {check.rtol:g}, atol {check.atol:g} x {check.atol_scaled_by})")
    return text + (f"; {check.note}" if check.note else "")


def run(args, env) -> int:
    from edgeq.bundle import read_manifest

    m = read_manifest(args.bundle)
    if args.json:
        print(json.dumps(m.to_json(), indent=2), file=env.stdout)
        return 0
    try:
        rows = _rows(m)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as err:
        raise BundleError(f"{args.bundle}: the manifest's {err} is missing or of the wrong type; "
                          "'edgeq inspect --json' prints it as it is") from None
    view = Table(title=Text(f"bundle {m.bundle_id}"), show_header=False)
    for key, value in rows:
        view.add_row(key, Text(value))  # manifest text is data, never rich markup
    env.out().print(view)
    return 0


def _rows(m) -> list[tuple[str, str]]:
    device, toolkit = m.device, m.toolchain.cuda_toolkit
    return [
        ("model", f"{m.model.file} (sha256 {m.model.sha256[:16]}…, opset {m.model.opset})"),
        ("precision", m.precision + (f" ({m.quantization.summary()})" if m.quantization else "")),
        ("device", f"{device.profile}: {device.description}"),
        ("host", f"{device.host_triple} ({device.mcpu})"),
        ("GPU code", f"{', '.join(m.library.cuda_device_code) or '-'}"
                     + (f" from CUDA {toolkit.version} {toolkit.kind}" if toolkit else "")),
        ("CPU kernels", _cpu_kernels(m.library.cpu_kernels)),
        ("GPU kernels", _gpu_kernels(m.library.gpu_kernels)),
        ("inputs", _tensors(m.inputs)),
        ("outputs", _tensors(m.outputs)),
        ("reference check", _reference_check(m.reference_check)),
        ("weights", f"{m.weights.count} tensors, {m.weights.bytes / 1e6:.2f} MB"),
        ("runtime", _runtime(m.runtime, m.compatibility)),
        ("built", f"{m.created} with edgeq {m.edgeq_version}, TVM {m.tvm_version}"),
        ("stage times", ", ".join(f"{k} {v:.2f}s" for k, v in m.build.get("stage_seconds", {}).items())),
        ("files", ", ".join(m.files)),
    ]
