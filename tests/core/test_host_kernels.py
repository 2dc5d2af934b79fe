"""The CPU kernels work in the tensor's own memory and match float64 references, through
PyTorch's own LAPACK and through SciPy's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core import host_kernels


@pytest.fixture(params=["linked", "scipy"])
def lapack(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each Cholesky test runs with PyTorch's own ``potrf`` and ``potri`` and with SciPy's."""
    if request.param == "scipy":
        monkeypatch.setattr(host_kernels, "LINKED_POTRF", {})
        monkeypatch.setattr(host_kernels, "LINKED_POTRI", {})
    elif not all([*host_kernels.LINKED_POTRF.values(), *host_kernels.LINKED_POTRI.values()]):
        pytest.skip("this PyTorch build exports no LAPACK potrf and potri")
    return str(request.param)


def test_pytorchs_own_lapack_is_found_where_it_links_mkl() -> None:
    if not torch.backends.mkl.is_available():
        pytest.skip("this PyTorch build has no MKL")
    assert all(host_kernels.LINKED_POTRF.values())
    assert all(host_kernels.LINKED_POTRI.values())


def _spd(n: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(3)
    x = torch.randn(n, 2 * n, dtype=torch.float64)
    return (x @ x.T / (2 * n)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lower_in_matrix", [True, False])
def test_cholesky_in_place_writes_one_triangle_and_leaves_the_other(
        dtype: torch.dtype, lower_in_matrix: bool, lapack: str) -> None:
    spd = _spd(9, dtype)
    matrix = spd.clone()
    address = matrix.data_ptr()
    assert host_kernels.cholesky_in_place(matrix, lower_in_matrix=lower_in_matrix) == 0
    assert matrix.data_ptr() == address
    expected = torch.linalg.cholesky(spd.double())  # lower L, A = L Lᵀ
    factor, untouched = ((matrix.tril(), matrix.triu(1)) if lower_in_matrix
                         else (matrix.triu().T, matrix.tril(-1)))
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(factor.double(), expected, **tolerance)
    kept = spd.triu(1) if lower_in_matrix else spd.tril(-1)
    assert torch.equal(untouched, kept)


def test_cholesky_in_place_reports_the_first_minor_that_is_not_positive_definite(
        lapack: str) -> None:
    matrix = torch.diag(torch.tensor([4.0, 1.0, -2.0, 3.0]))
    assert host_kernels.cholesky_in_place(matrix, lower_in_matrix=True) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 9, 130])
def test_inverse_from_cholesky_in_place_is_the_exactly_symmetric_inverse(
        dtype: torch.dtype, n: int, lapack: str) -> None:
    """``potrf`` then ``potri`` and the mirror, in the matrix's own memory, against the
    float64 inverse; 130 crosses the mirror's 64-row panels."""
    spd = _spd(n, dtype)
    matrix = spd.clone()
    address = matrix.data_ptr()
    assert host_kernels.cholesky_in_place(matrix, lower_in_matrix=False) == 0
    assert host_kernels.inverse_from_cholesky_in_place(matrix) == 0
    assert matrix.data_ptr() == address
    assert torch.equal(matrix, matrix.T)
    expected = torch.linalg.inv(spd.double())
    tolerance = {"rtol": 1e-3, "atol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(matrix.double(), expected, **tolerance)


def test_inverse_from_cholesky_in_place_reports_a_zero_pivot(lapack: str) -> None:
    """A factor with a zero on its diagonal has no inverse: LAPACK's ``info`` names it."""
    factor = torch.tensor([[2.0, 1.0, 0.5], [0.0, 0.0, 1.0], [0.0, 0.0, 3.0]])  # Lᵀ, upper
    assert host_kernels.inverse_from_cholesky_in_place(factor) == 2


def test_cholesky_in_place_refuses_a_matrix_it_would_have_to_copy() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        host_kernels.cholesky_in_place(torch.eye(4)[:, ::2], lower_in_matrix=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 256, 512, 520])
def test_mirror_upper_copies_the_upper_triangle_exactly_in_place(dtype: torch.dtype,
                                                                  n: int) -> None:
    """Panel edges included, for panels of 64, 32 and 16 rows (``mirror_panel``: fp32
    rows of 256 and 512, fp64 rows of 256 and 512 share powers of two with the L1 set stride;
    520 ends on a partial panel): the result is the upper triangle reflected, bit for bit, in
    the matrix's own memory."""
    torch.manual_seed(4)
    matrix = torch.randn(n, n, dtype=dtype)
    upper = matrix.triu()
    address = matrix.data_ptr()
    host_kernels.mirror_upper(matrix)
    assert matrix.data_ptr() == address
    assert torch.equal(matrix, upper + upper.triu(1).T)


@pytest.mark.parametrize(("row_bytes", "panel"), [
    (4 * 1024, 16), (4 * 2048, 16), (4 * 4608, 16), (4 * 256, 32), (4 * 2304, 32),
    (4 * 1025, 64), (4 * 1152, 64), (4 * 64, 64), (8 * 256, 16), (8 * 520, 64)])
def test_mirror_panel_fits_the_l1_sets_a_column_of_the_panel_falls_in(row_bytes: int,
                                                                      panel: int) -> None:
    """Rows that are a multiple of 4 KiB put every line of a column in one L1 set, so the
    panel is the 16-row floor; each halving of the shared power of two doubles the sets, up
    to the 64-row cap."""
    assert host_kernels.mirror_panel(row_bytes) == panel


def test_syrk_upper_of_no_rows_is_beta_times_out() -> None:
    """BLAS rejects a product over no rows; the answer is ``beta·out`` (zeros for ``beta`` 0,
    whatever ``out`` held)."""
    out = torch.full((3, 3), float("nan"))
    host_kernels.syrk_upper(out, torch.empty(3, 0), scale=1.0, beta=0.0)
    assert torch.equal(out, torch.zeros(3, 3))
    out = torch.full((3, 3), 2.0)
    host_kernels.syrk_upper(out, torch.empty(3, 0), scale=1.0, beta=0.5)
    assert torch.equal(out, torch.ones(3, 3))


def test_syrk_upper_refuses_an_out_it_would_write_a_copy_of() -> None:
    m = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        host_kernels.syrk_upper(torch.zeros(4, 4).T, m, scale=1.0, beta=0.0)
    out = torch.zeros(4, 4)
    host_kernels.syrk_upper(out, m, scale=1.0, beta=0.0)
    upper = torch.ones(4, 4, dtype=torch.bool).triu()
    torch.testing.assert_close(out[upper], (m @ m.T)[upper])


@pytest.mark.parametrize(("text", "vendor"), [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n", "AuthenticAMD"),
    ("processor\t: 0\nvendor_id\t: GenuineIntel\n\nprocessor\t: 1\n", "GenuineIntel"),
    ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", None),
    ("vendor_id\t:\n", None),
])
def test_cpu_vendor_reads_the_vendor_id_line(tmp_path: Path, text: str, vendor: str | None
                                             ) -> None:
    """An aarch64 ``/proc/cpuinfo`` has no ``vendor_id`` line; a missing or unreadable file
    names none."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert host_kernels.cpu_vendor(cpuinfo) == vendor
    assert host_kernels.cpu_vendor(tmp_path / "absent") is None
    assert host_kernels.cpu_vendor(tmp_path) is None  # unreadable: a directory


def test_cpuinfo_field_reads_the_first_line_of_its_key_whole(tmp_path: Path) -> None:
    """A value keeps its own colons; the first processor's line is the one read."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Vendor CPU: v2 @ 2.0GHz\n\n"
                       "processor\t: 1\nmodel name\t: other\n")
    assert host_kernels.cpuinfo_field("model name", cpuinfo) == "Vendor CPU: v2 @ 2.0GHz"
    assert host_kernels.cpuinfo_field("flags", cpuinfo) is None
