import subprocess
import sys

ENGINE_MODULES = ["core", "encoder_budget", "kv_manager", "output", "plan", "request",
                  "scheduler", "stats"]


def test_engine_package_imports_no_torch():
    imports = "; ".join(f"import foveal.engine.{name}" for name in ENGINE_MODULES)
    code = f"import sys; {imports}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
