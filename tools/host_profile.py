#!/usr/bin/env python3
"""Where the host's time goes, from a tools/host_sampler.cc sample file.

  python3 tools/host_profile.py samples.txt --binaries build/release [--top 40] [--last_s 5]

Each sample is a backtrace taken every millisecond of CPU time (of wall time, main thread only,
under RD_HOST_SAMPLE_CLOCK=wall). The return addresses are
mapped to (module, offset) through the process's memory map and symbolized with addr2line
against the unstripped programs of --binaries (the packed ones are stripped; same build, same
offsets); other modules (libcuda, libcudnn) keep their file name. Prints markdown: the
functions the samples were in (self), the functions on their stacks (inclusive), and for
samples outside our code, the innermost of our functions that called out (who pays for the
time spent in CUDA, cuDNN or the C++ runtime).
"""
import argparse
import bisect
import collections
import os
import re
import subprocess


def read_samples(path):
    samples, maps, in_maps, clock = [], [], False, "cpu"
    with open(path) as f:
        for line in f:
            if line.startswith("# maps"):
                in_maps = True
            elif line.startswith("# samples"):
                clock = line.split()[-1] if "clock" in line else "cpu"
            elif line.startswith("#"):
                continue
            elif in_maps:
                parts = line.split()
                if len(parts) >= 6 and "x" in parts[1]:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    maps.append((lo, hi, int(parts[2], 16), parts[5]))
            else:
                fields = line.split()
                samples.append((int(fields[0]), [int(a, 16) for a in fields[1:]]))
    maps.sort()
    return samples, maps, clock


def load_segments(binary):
    """(p_offset, p_vaddr, p_filesz) of the executable LOAD segments, to turn a file offset
    into the address addr2line expects."""
    out = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True).stdout
    segments = []
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == "LOAD":
            segments.append((int(fields[1], 16), int(fields[2], 16), int(fields[4], 16)))
    return segments


def find_local(module, roots):
    name = os.path.basename(module)
    for root in roots:
        for directory, _, files in os.walk(root):
            if name in files:
                return os.path.join(directory, name)
    return None


def symbolize(addresses, maps, roots):
    """address -> function name (or the module's file name)."""
    starts = [m[0] for m in maps]
    by_module = collections.defaultdict(set)
    module_of = {}
    for address in addresses:
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address < maps[i][1]:
            lo, _, offset, module = maps[i]
            # A return address points after the call; one byte back lies inside it.
            module_of[address] = (module, address - 1 - lo + offset)
            by_module[module].add(address - 1 - lo + offset)
    names = {}
    for module, offsets in by_module.items():
        local = find_local(module, roots)
        if local is None:
            for address, (m, _) in module_of.items():
                if m == module:
                    names[address] = os.path.basename(module)
            continue
        segments = load_segments(local)
        ordered = sorted(offsets)
        vaddrs = []
        for off in ordered:
            vaddr = off
            for p_offset, p_vaddr, size in segments:
                if p_offset <= off < p_offset + size:
                    vaddr = off - p_offset + p_vaddr
            vaddrs.append(vaddr)
        out = subprocess.run(["addr2line", "-f", "-C", "-e", local] + [hex(v) for v in vaddrs],
                             capture_output=True, text=True).stdout.splitlines()
        function_at = {off: out[2 * k] for k, off in enumerate(ordered) if 2 * k < len(out)}
        for address, (m, off) in module_of.items():
            if m == module:
                names[address] = function_at.get(off, "??")
    return names


def ours(name):
    return name.startswith("rd::") or " rd::" in name[:40]


def short(name, width=140):
    """The function's name without namespaces that repeat and without its parameter list."""
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\s+const$", "", name)
    if name.endswith(")"):  # cut at the '(' that matches the last ')'
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("samples")
    parser.add_argument("--binaries", action="append", default=[],
                        help="a folder holding the unstripped programs and libraries")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--last_s", type=float, default=0,
                        help="only the samples of the last this many seconds (the steady state)")
    parser.add_argument("--drop_last_s", type=float, default=0,
                        help="with --last_s: the window ends this many seconds before the end "
                        "(leaving out a final evaluation and checkpoint)")
    args = parser.parse_args()
    samples, maps, clock = read_samples(args.samples)
    if args.last_s:
        end = max(t for t, _ in samples) - args.drop_last_s * 1e9
        samples = [(t, s) for t, s in samples if end - args.last_s * 1e9 <= t <= end]
    samples = [s for _, s in samples]
    names = symbolize({a for s in samples for a in s}, maps, args.binaries or ["build/release"])
    total = len(samples)
    self_count, inclusive, payer = (collections.Counter() for _ in range(3))
    for stack in samples:
        frames = [short(names.get(a, "?")) for a in stack[2:]]  # the handler's own frames go
        if not frames:
            continue
        self_count[frames[0]] += 1
        for name in set(frames):
            inclusive[name] += 1
        if not ours(frames[0]):
            caller = next((f for f in frames if ours(f)), "(none of ours)")
            payer[f"{caller}  ->  {frames[0]}"] += 1
    what = "wall time of the main thread" if clock == "wall" else "CPU time"
    print(f"{total} samples (1 ms of {what} each)\n")
    for title, counter in (("self", self_count), ("inclusive", inclusive),
                           ("outside our code, by our innermost caller", payer)):
        print(f"| {title} (top {args.top}) | samples | share |")
        print("| --- | ---: | ---: |")
        for name, count in counter.most_common(args.top):
            print(f"| `{name}` | {count} | {100 * count / total:.1f}% |")
        print()


if __name__ == "__main__":
    main()
