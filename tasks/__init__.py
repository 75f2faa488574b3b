"""The stage library: every stage runs inside a Ray job (or as a plain process) and never imports airflow.

Importing it pins the CPU code paths that decide floating-point results, before any tensor is computed:
MKL's conditional numerical reproducibility at AVX2 in strict mode, torch's own vectorised kernels at AVX2,
and oneDNN at AVX2. Without the pins, MKL and torch pick AVX-512 kernels where the CPU has them, floats sum
in another order, and a 500-step run ends in another model: the demo's SFT model differed between two
machines with the same package versions. With them, any x86-64 CPU with AVX2 is meant to take the code
paths this one takes (confirmed here only: no other CPU kind was at hand). A variable already set wins.
GPU kernels are not affected.
"""

import os
import platform

if platform.machine() in ("x86_64", "AMD64"):
    for _name, _value in (("MKL_CBWR", "AVX2,STRICT"), ("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        os.environ.setdefault(_name, _value)
