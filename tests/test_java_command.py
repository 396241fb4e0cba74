"""Every JVM the tests start goes through java_build.java_command, so the short-lived JVMs' flags
(C1 only, the serial collector: a fifth less CPU) live in one place and no test starts one without."""

import ast
from pathlib import Path

import java_build

TESTS = Path(__file__).resolve().parent


def bare_java_argvs(source: str) -> list[int]:
    """Lines of the list displays that start with the string "java" (after any starred prefix)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List):
            heads = [e for e in node.elts if not isinstance(e, ast.Starred)][:1]
            if heads and isinstance(heads[0], ast.Constant) and heads[0].value == "java":
                lines.append(node.lineno)
    return sorted(lines)


def test_no_test_starts_a_jvm_without_the_test_flags():
    sources = {p.name: p.read_text() for p in sorted(TESTS.rglob("*.py"))
               if p.name != "java_build.py"}                # where java_command builds the argv
    found = {name: bare_java_argvs(text) for name, text in sources.items() if '"java"' in text}   # parse those only
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_finds_a_bare_java_argv():
    assert bare_java_argvs('subprocess.run(["java", "-cp", cp, "Main"])\nx = [*prefix, "java", "-cp", cp]\n') == [1, 2]
    assert bare_java_argvs('subprocess.run(java_build.java_command("-cp", cp, "Main"))\nx = ["py", "java"]\n') == []


def test_java_command_puts_the_flags_before_the_callers_arguments():
    argv = java_build.java_command("-Xmx128m", "-cp", "x", "Main", "arg")
    assert argv[0] == "java" and argv[1:] == [*java_build.TEST_JVM_FLAGS, "-Xmx128m", "-cp", "x", "Main", "arg"]
    assert "-XX:TieredStopAtLevel=1" in argv and "-XX:+UseSerialGC" in argv
