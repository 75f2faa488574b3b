"""The stage library: every stage runs inside a Ray job (or as a plain process) and never imports airflow.

Importing it pins the CPU code paths that decide floating-point results, before any tensor is computed, so
the same commit, lock and seed give the same numbers on any x86-64 machine with AVX2 (Intel or AMD, any
core count): MKL's conditional numerical reproducibility (the AVX2 code path, bitwise the same whatever the
thread count for its matrix products), torch's own vectorised kernels at AVX2, and oneDNN at AVX2. Without
this, MKL and torch pick AVX-512 kernels where the CPU has them, and the demo's SFT model came out
different on another machine from the same install. A variable already set wins. GPU kernels are not
affected.
"""
import os
import platform

if platform.machine() in ("x86_64", "AMD64"):
    for _name, _value in (("MKL_CBWR", "AVX2,STRICT"), ("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        os.environ.setdefault(_name, _value)
