"""benchmarks/inspect_kernels.py's SASS loop counter (`--loop-mix`), on a hand-written listing in nvdisasm's format
(no compiler, no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import inspect_kernels  # noqa: E402

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDS.64 R66, [R151+UR8+0x8000] ;
        /*0020*/                   F2FP.F16.E4M3.UNPACK_B R36, R44 ;
        /*0030*/                   IMAD.MOV.U32 R32, RZ, RZ, R66.reuse ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   HMMA.16816.F32 R36, R32, R36, RZ ;
.L_x_1:
        /*0060*/                   IMAD.MOV.U32 R40, RZ, RZ, R66 ;
        /*0070*/              @!P4 BRA `(.L_x_0) ;
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*00a0*/               @P1 BRA `(.L_x_2) ;
"""


def test_sass_loops_counts_each_backward_branch_body_by_opcode():
    loops = inspect_kernels.sass_loops(LISTING)
    assert [count for count, _ in loops] == [7, 2]  # the forward branch to .L_x_1 is not a loop
    first, second = (ops for _, ops in loops)
    assert first == {"LDS": 1, "F2FP": 1, "IMAD": 2, "BRA": 2, "HMMA": 1}  # modifiers and predicates dropped
    assert second == {"LDG": 1, "BRA": 1}
