#!/usr/bin/env python3
"""kernel_profile_test.py KERNEL_PROFILE: runs tools/kernel_profile.py on a synthetic trace of
four optimizer steps whose times are known, and checks the step, busy, idle and per-category
times it reports, where it was idle, the host's calls (and their share while the GPU idled),
and that a trace without two steps is refused."""
import os
import subprocess
import sys
import tempfile

MS = 1_000_000  # ns


def write_trace(path, steps):
    """Each step: a GEMM (10 ms), an elementwise kernel (4 ms) beside a 1 ms memcpy on
    another stream that overlaps it, 2 ms of idle GPU, then two AdamW kernels (0.5 ms each).
    On the host (RD_CUPTI_API rows): a 0.1 ms launch during the GEMM, and a 2 ms
    synchronization from 1 ms before the idle gap into its middle."""
    rows, t = [], 0
    for _ in range(steps):
        rows.append(("kernel", t, t + 10 * MS, 7, 0, "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN"))
        rows.append(("driver", t + MS, t + MS + MS // 10, 0, 0, "cuLaunchKernel"))
        rows.append(("runtime", t + 13 * MS, t + 15 * MS, 0, 0, "cudaStreamSynchronize_v3020"))
        t += 10 * MS
        rows.append(("kernel", t, t + 4 * MS, 7, 0,
                     "void rd::kernels::cuda::grid_stride_kernel<rd::kernels::cuda::VectorBody<8, "
                     "rd::kernels::cuda::(anonymous namespace)::BinaryFn<(rd::kernels::BinaryOp)2, "
                     "float>, rd::BFloat16> >(long, rd::kernels::cuda::VectorBody<8, x>)"))
        rows.append(("memcpy", t + MS, t + 2 * MS, 9, 4096, "memcpy kind 1"))
        t += 4 * MS + 2 * MS
        for _ in range(2):
            rows.append(("kernel", t, t + MS // 2, 7, 0, "void rd::kernels::cuda::adamw_kernel<float>(x)"))
            t += MS // 2
    with open(path, "w") as f:
        f.write("kind,start_ns,end_ns,stream,bytes,name\n")
        for kind, start, end, stream, nbytes, name in rows:
            f.write(f'{kind},{start},{end},{stream},{nbytes},"{name}"\n')


def main():
    tool = sys.argv[1]
    with tempfile.TemporaryDirectory() as work:
        trace = os.path.join(work, "trace.csv")
        write_trace(trace, 4)
        out = subprocess.run([sys.executable, tool, trace, "--steps", "3"], check=True,
                             capture_output=True, text=True).stdout
        expected = [
            "the last 3 of 4 steps",
            "| step (optimizer to optimizer) | 17.00 | 100% |",
            "| GPU busy | 15.00 | 88.2% |",
            "| GPU idle (waiting on the host) | 2.00 | 11.8% |",
            "| GEMM (cuBLASLt) | 10.00 | 58.8% | 1 |",
            "| elementwise / copies | 4.00 | 23.5% | 1 |",
            "| optimizer (AdamW, multi-tensor) | 1.00 | 5.9% | 2 |",
            "| memcpy | 1.00 | 5.9% | 1 |",
            "grid_stride_kernel<VectorBody<8, BinaryFn<(BinaryOp)2, float>, BFloat16> >",
            # The 2 ms the GPU waits before each step's optimizer, charged to the AdamW kernel.
            "| `adamw_kernel<float>` | 2.000 | 1 |",
            # Host calls per step, and how much of each the GPU spent idle.
            "| `cudaStreamSynchronize_v3020` | 2.000 | 1.0 | 1.000 |",
            "| `cuLaunchKernel` | 0.100 | 1.0 | 0.000 |",
        ]
        missing = [line for line in expected if line not in out]
        if missing:
            sys.exit("kernel_profile_test: FAILED: missing " + repr(missing) + " in:\n" + out)
        write_trace(trace, 1)
        one = subprocess.run([sys.executable, tool, trace], capture_output=True, text=True)
        if one.returncode == 0 or "need at least 2" not in one.stderr:
            sys.exit("kernel_profile_test: FAILED: a one-step trace was not refused: " + one.stderr)
    print("kernel_profile_test: passed")


if __name__ == "__main__":
    main()
