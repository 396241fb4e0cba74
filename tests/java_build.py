"""Building the Java device library (clients/java/) for the tests: plain javac at Java 11 level
against Debian's jars (``make setup`` installs them: default-jdk-headless, libbcprov-java,
libmqtt-client-java). Nothing is downloaded."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared_build import build_once

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "clients" / "java" / "src"
DEBIAN_JARS = Path("/usr/share/java")
JARS = ("bcprov", "mqtt-client", "hawtbuf", "hawtdispatch", "hawtdispatch-transport")


def missing() -> str | None:
    """Why the Java library cannot be built here, or None."""
    if shutil.which("javac") is None or shutil.which("java") is None:
        return "needs a JDK (javac and java on PATH; make setup installs default-jdk-headless)"
    absent = [j for j in JARS if not (DEBIAN_JARS / f"{j}.jar").exists()]
    if absent:
        return f"needs Debian's Java libraries {absent} in /usr/share/java (make setup installs them)"
    return None


def classpath(*extra: Path) -> str:
    return ":".join([*(str(p) for p in extra), *(str(DEBIAN_JARS / f"{j}.jar") for j in JARS)])


DRIVERS = (ROOT / "tests" / "conformance" / "java", ROOT / "tests" / "java_device")

# The tests' JVMs live for seconds, so the JIT's top tier never pays back what it costs: C1 only
# (TieredStopAtLevel=1) on one compiler thread, and the serial collector instead of G1's
# concurrent threads. Together about 15% less CPU over the 22 test files that start JVMs (about
# 170 -> 145 CPU-s). Flags on the command line, not in JAVA_TOOL_OPTIONS: with that the JVM prints a
# "Picked up" note on stderr, which tests read. The product's devices keep the JVM's defaults.
TEST_JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:CICompilerCount=1", "-XX:+UseSerialGC")


def java_command(*args: str) -> list[str]:
    """The argv of a test's JVM: ``java``, TEST_JVM_FLAGS, then ``args`` (-cp, main class, ...)."""
    return ["java", *TEST_JVM_FLAGS, *args]


@functools.lru_cache(maxsize=1)
def built() -> str:
    """The library and every test driver, compiled once per pytest run (the xdist workers of a run
    share PYTEST_XDIST_TESTRUNUID, and the first to ask compiles for all); returns the classpath."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return build(Path(tempfile.mkdtemp(prefix="fedfleet-java-")) / "classes", *DRIVERS)
    folder = build_once(Path(tempfile.gettempdir()) / f"fedfleet-java-{run}",
                        lambda d: build(d / "classes", *DRIVERS))
    return classpath(folder / "classes")


def build(out: Path, *extra_sources: Path) -> str:
    """Compile the library (and ``extra_sources``) into ``out``; returns the run classpath."""
    sources = sorted(LIBRARY.rglob("*.java")) + [s for d in extra_sources for s in sorted(Path(d).glob("*.java"))]
    proc = subprocess.run(["javac", "--release", "11", "-Xlint:all", "-Xlint:-path", "-Xlint:-serial", "-Werror", "-d", str(out),
                           "-cp", classpath(), *map(str, sources)], capture_output=True, text=True, timeout=180)
    if proc.returncode:
        raise RuntimeError(f"javac failed:\n{proc.stdout}\n{proc.stderr}")
    return classpath(out)
