"""Fakes of APIs this machine cannot reach (a GPU driver, another OS). Each follows the
real API's semantics and names the source it follows; tests that use one say "fake"."""
