"""The SASS check behind the compile tests' wgmma register tests
(:func:`sm90_compile.wgmma_register_hazards`), on hand-written sm_90 listings: what it reports and
what it lets pass."""

from __future__ import annotations

from sm90_compile import wgmma_register_hazards


def _listing(*instructions: str) -> str:
    """``cuobjdump -sass``-style lines, 16 bytes apart from address 0."""
    return "\n".join(
        f"        /*{16 * i:04x}*/                   {text} ;  /* 0x0 */"
        for i, text in enumerate(instructions)
    )


PV = (
    "WARPGROUP.ARRIVE",
    "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R152, gdesc[UR4], R88",
    "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R156, gdesc[UR4], R88, gsb0",
)
"""One commit group: two 8-bit products with their A operand in R152-R159, accumulating into
R88-R151."""


def test_a_write_to_an_in_flight_a_operand_is_reported() -> None:
    hazards = wgmma_register_hazards(
        _listing(*PV, "F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R157, R25, R22, RZ")
    )
    assert len(hazards) == 1
    assert "R157" in hazards[0]


def test_reading_the_accumulator_before_the_wait_is_reported() -> None:
    assert len(wgmma_register_hazards(_listing(*PV, "FMUL R20, R90, R17"))) == 1


def test_the_wait_that_retires_the_group_ends_the_check() -> None:
    listing = _listing(*PV, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMUL R90, R90, R17", "MOV R152, RZ")
    assert wgmma_register_hazards(listing) == []


def test_a_wait_that_leaves_the_group_pending_does_not() -> None:
    """``DEPBAR.LE gsb0, 0x1`` with no later group leaves this one in flight."""
    listing = _listing(*PV, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MOV R152, RZ")
    assert len(wgmma_register_hazards(listing)) == 1


def test_a_later_group_lets_a_one_pending_wait_retire_the_earlier() -> None:
    """Scores in R24-R87 issued after P·V: ``DEPBAR.LE gsb0, 0x1`` retires P·V only, so writing P's
    registers is fine and reading the scores is not."""
    scores = "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT, gsb0"
    fine = _listing(*PV, scores, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "MOV R152, RZ")
    assert wgmma_register_hazards(fine) == []
    early = _listing(*PV, scores, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "FMNMX R15, R24, R25, !PT")
    assert len(wgmma_register_hazards(early)) == 1


def test_a_hazard_on_a_branch_target_is_found() -> None:
    """The check follows branches: the write sits past the wait's fall-through path, where the
    conditional branch jumps."""
    listing = _listing(
        *PV,
        "@P0 BRA 0x60",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "EXIT",
        "MOV R153, RZ",
    )
    hazards = wgmma_register_hazards(listing)
    assert len(hazards) == 1
    assert "00060" in hazards[0]
