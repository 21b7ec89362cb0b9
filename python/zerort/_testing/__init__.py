"""What zerort's tests and benchmarks use and a training script does not: the kernels on
torch tensors (kernels: cast, adamw_step, unscale_and_check, sum_chunks_to_f32) and one way
to start a test's ranks as processes (launch). Not part of zerort's API."""
from zerort._testing import kernels, launch  # noqa: F401
from zerort._testing.kernels import adamw_step, cast, sum_chunks_to_f32, unscale_and_check  # noqa: F401
