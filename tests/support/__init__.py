"""What the tests share, written once: the repository's paths (`paths`), waiting for a
condition (`waiting`), a stand-in for pynvml (`fake_nvml`), a sidecar in a thread with a fake
allocator source (`sidecar`), a sidecar with the policy, admin and reload sections (`control`),
test certificates (`pki`), the deploy checks' paths and tools (`deploy`), and repeated steps on
the simulated device (`page_steps`). Free TCP ports come from the benchmarks' own helper,
`bench.lib.ports`.

Importable as `support` from any test: tests/ is on sys.path through tests/conftest.py.
"""
