"""What the tests share, written once: the repository's paths (`paths`), waiting for a
condition (`waiting`), a free TCP port (`net`), a stand-in for pynvml (`fake_nvml`), a sidecar
in a thread with a fake allocator source (`sidecar`), a sidecar with the policy, admin and
reload sections (`control`), test certificates (`pki`) and the deploy checks' paths and tools
(`deploy`).

Importable as `support` from any test: tests/ is on sys.path through tests/conftest.py.
"""
