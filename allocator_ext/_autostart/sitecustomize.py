"""Loaded at interpreter start-up in processes launched by `allocwatch run` (this folder is put
first on PYTHONPATH): installs allocwatch's allocator and starts the agent when the program
imports torch, so no code change is needed — torchrun's workers included, since they inherit the
environment. Start-up itself imports nothing but the standard library: a process that never
imports torch is left exactly as it was, and installing makes no CUDA driver call, so CUDA
starts when the program first uses it (as PyTorch's own test_lazy_init checks). Nothing here may
break the user's program: failures become one line on stderr.

The environment (documented in docs/torch.md): ALLOCWATCH_RUN=1 turns this on; ALLOCWATCH_TARGET
the sidecar (the agent starts at the process's first CUDA use; ALLOCWATCH_AGENT_CONNECT);
ALLOCWATCH_ALLOC_CONF the settings; ALLOCWATCH_ALLOCATOR=0 keeps PyTorch's allocator;
ALLOCWATCH_DISABLE=1 keeps it and says so; ALLOCWATCH_NATIVE=0 asks for the pluggable path;
ALLOCWATCH_NATIVE_DIR where the native back end is cached."""

import os
import sys

# Launchers that start the training processes and use no GPU themselves, as scripts on PATH
# and as modules run with -m: torchrun's, Hugging Face Accelerate's (`accelerate launch`) and
# DeepSpeed's (`deepspeed`, which runs deepspeed.launcher.launch on each node).
_LAUNCHERS = {"torchrun", "torch.distributed.run", "torch.distributed.launch",
              "accelerate", "accelerate.commands.launch", "accelerate.commands.accelerate_cli",
              "deepspeed", "deepspeed.launcher.runner", "deepspeed.launcher.launch"}


def _is_launcher() -> bool:
    """A launcher's own process (torchrun's, Accelerate's, DeepSpeed's): it starts the workers
    and touches no GPU, so it gets no allocator and no agent (its workers do, as they inherit
    the environment)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    if len(argv) > 1 and os.path.basename(argv[1]) in _LAUNCHERS:
        return True
    return any(a == "-m" and b in _LAUNCHERS for a, b in zip(argv, argv[1:], strict=False))


def _install_after_torch() -> None:
    try:
        from allocator_ext.torch_integration import install_at_startup

        install_at_startup()
    except Exception as e:  # noqa: BLE001 - the training process comes first
        print(f"allocwatch: not installed in pid {os.getpid()}: {e}", file=sys.stderr)


class _AfterTorchImport:
    """A meta-path finder that finds nothing itself: when `torch` is imported, it lets the
    other finders find it and wraps the loader's exec_module, so that allocwatch installs the
    moment torch's own import has finished — before the program's next line."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install_after_torch()

        spec.loader.exec_module = exec_then_install
        return spec


def _allocwatch_autostart() -> None:
    if os.environ.get("ALLOCWATCH_RUN") != "1" or _is_launcher():
        return
    if "torch" in sys.modules:  # imported before site ran (an embedding program)
        _install_after_torch()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())


def _chain_to_the_next_sitecustomize() -> None:
    """A site's own sitecustomize further down sys.path still runs; never this file again,
    whatever path reaches it (a symlink, the resolved path `allocwatch run` puts on
    PYTHONPATH beside the one the .pth file adds): it would chain to itself."""
    this = os.path.realpath(__file__)
    import importlib.util

    for entry in sys.path:
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry and os.path.isfile(candidate) and os.path.realpath(candidate) != this:
            spec = importlib.util.spec_from_file_location("_site_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_allocwatch_autostart()
_chain_to_the_next_sitecustomize()
