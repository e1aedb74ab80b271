#!/usr/bin/env python3
"""Fails when a script the README tells users to run needs something the README does not say
how to get.

The README promises that its commands work as root on a fresh Debian 12 with the Rust toolchain:
whatever else they need, the scripts install (Debian packages, cargo-pgrx, drivers), or the
README names it. This reads every script the README names and every script those call, and
checks three kinds of need:

- Commands. Each command a script runs is a shell builtin, a function or script of the
  repository, the Rust toolchain's, part of every Debian system (its package's priority is
  required or important), or from a Debian package that a script installs. A command that is
  none of these (say, `hyperfine` added to test.sh without installing it) fails the check, as
  does one that is not on this machine at all and that no script installs.
- Settings. Each INBOX_* environment variable a script reads from its caller is named in the
  README, so that a run which needs one (INBOX_CITUS_SOURCE) says where it comes from.
- Files. No script reads a file outside the repository by a fixed path of one machine's layout
  (`/work/...`, `../shared/...`).

    scripts/check-readme-needs.py          # exit status 1, with each need, when one is unmet
"""

import os
import re
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the README says the commands start from: git (the clone) and the Rust toolchain.
PREREQUISITES = {"git", "cargo", "rustc", "rustup"}

BASH_WORDS = set(
    """if then else elif fi case esac for while until do done in function select time coproc
    alias bg bind break builtin caller cd command compgen complete continue declare dirs disown
    echo enable eval exec exit export false fc fg getopts hash help history jobs kill let local
    logout mapfile popd printf pushd pwd read readarray readonly return set shift shopt source
    suspend test times trap true type typeset ulimit umask unalias unset wait""".split()
)

# Words after which the next word is a command: the shell's own separators, and the wrappers the
# scripts run commands through (their own arguments are skipped: see WRAPPER_ARGS).
COMMAND_STARTS = {"|", "||", "&&", ";", "(", "{", "!", "$(", "then", "do", "else", "elif", "if",
                  "while", "until", "exec", "time", "command"}
WRAPPER_ARGS = {"as_postgres": 0, "flock": 1, "sudo": None, "env": None, "xargs": None,
                "nohup": 0, "timeout": 1}


def script_paths_named(text):
    """Scripts of the repository named in a text: ./scripts/x.sh, scripts/x.py, examples/run.sh."""
    found = set()
    for match in re.finditer(r"(?:\./)?((?:scripts|examples)/[\w./-]+\.(?:sh|py)|\.ci/run)\b", text):
        path = os.path.join(REPO, match.group(1))
        if os.path.isfile(path):
            found.add(os.path.normpath(path))
    return found


def strip_heredocs_and_comments(text):
    """The script's lines without comments and without the bodies of here-documents (a config
    file written by cat <<EOF is not commands)."""
    lines, out, end = text.replace("\\\n", " ").splitlines(), [], None
    for line in lines:
        if end is not None:
            if line.strip() == end:
                end = None
            continue
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if heredoc:
            end = heredoc.group(1)
        if line.lstrip().startswith("#"):
            continue
        out.append(re.sub(r"\s#\s.*$", "", line))
    return "\n".join(out)


def unquote(text):
    """The script with its quoted text replaced by a plain word Q, except command substitutions
    inside double quotes ("$(cmd ...)"), whose commands are kept; arithmetic ((...)) dropped."""
    # One entry per open "...", $(...), (...) or array=(...); inside "..." only $( and the
    # closing quote matter.
    out, i, stack = [], 0, ["code"]
    while i < len(text):
        c, state = text[i], stack[-1]
        if state == "dq":
            if c == "\\":
                i += 2
                continue
            if c == '"':
                stack.pop()
            elif text.startswith("$(", i) and not text.startswith("$((", i):
                stack.append("sub")
                out.append(" ; ")
                i += 2
                continue
            i += 1
            continue
        if c == "\\":
            out.append(text[i:i + 2])
            i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            out.append(" Q ")
            i = len(text) if end < 0 else end + 1
        elif c == '"':
            stack.append("dq")
            out.append(" Q ")
            i += 1
        elif text.startswith("$((", i) or text.startswith("((", i):
            end = text.find("))", i)
            out.append(" Q ")
            i = len(text) if end < 0 else end + 2
        elif text.startswith("$(", i):
            stack.append("sub")
            out.append(" $( ")
            i += 2
        elif c == "(" and out and out[-1].endswith("="):  # an array's elements: words, not commands
            stack.append("array")
            out.append(" Q ")
            i += 1
        elif c == "(":
            stack.append("paren")
            out.append(" ( ")
            i += 1
        elif c == ")" and len(stack) > 1:
            out.append({"paren": " ) ", "sub": " ; ", "array": " "}[stack.pop()])
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def tokens(line):
    """Shell words of a line, separators kept as words of their own."""
    return re.findall(r"\$\(|\|\||&&|[|;(){}]|[^\s|;(){}]+", line)


def commands_of_bash(text):
    found = set()
    text = unquote(strip_heredocs_and_comments(text))
    # case labels ("start)", "--quick)", "*)"), which are not commands
    text = re.sub(r"^\s*[\w*|.-]+\)", " ", text, flags=re.M)
    for line in text.splitlines():
        words = tokens(line)
        expect, skip = True, 0
        for word in words:
            if skip:
                skip -= 1
                continue
            if word in COMMAND_STARTS:
                expect = True
                continue
            if not expect:
                continue
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=.*", word):
                continue  # an assignment before the command
            if word in WRAPPER_ARGS:
                found.add(word)
                n = WRAPPER_ARGS[word]
                if n is None:  # options up to "--" or to the first word that is not one
                    expect, skip = "options", 0
                else:
                    skip = n
                continue
            if expect == "options" and (word.startswith("-") or "=" in word or word == "postgres"):
                continue
            expect = False
            if re.fullmatch(r"[a-z][a-z0-9_.+-]*", word):
                found.add(word)
            elif re.fullmatch(r"/(usr/)?s?bin/[a-z][a-z0-9_.+-]*", word):
                found.add(os.path.basename(word))
    return found


def functions_of(text):
    return set(re.findall(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(\)\s*\{", text, re.M))


def installed_packages_named(text):
    """Debian packages a script installs: the lists it checks with dpkg and installs what is
    missing of, and the names it adds to its list of missing packages."""
    packages = set()
    for match in re.finditer(r"for pkg in ([^;]+);", text):
        packages.update(match.group(1).split())
    packages.update(re.findall(r"missing\+=\(([a-z0-9.+-]+)\)", text))
    for match in re.finditer(r"apt_install\s+([^\n]+)", text):
        packages.update(w for w in match.group(1).split() if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w))
    return packages


def inputs_of(text):
    """INBOX_* variables a script reads ($X or ${X...}); those some script sets are taken out
    by the caller, and the rest come from the script's caller."""
    return set(re.findall(r"\$\{?(INBOX_[A-Z0-9_]+)", text))


def package_of(command):
    path = shutil.which(command)
    if not path:
        return None
    for candidate in {path, os.path.realpath(path), path.replace("/usr/bin/", "/bin/"),
                      path.replace("/usr/sbin/", "/sbin/")}:
        out = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.split(":")[0].split(",")[0].strip()
    return "(not from a Debian package: " + path + ")"


def with_dependencies(packages):
    """The packages and, for those installed here, everything they depend on, recursively."""
    todo, closure = list(packages), set()
    while todo:
        package = todo.pop()
        if package in closure:
            continue
        closure.add(package)
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Depends},${Pre-Depends}", package],
                             capture_output=True, text=True)
        for alternatives in out.stdout.split(","):
            for name in alternatives.split("|"):
                name = name.strip().split(" ")[0].split(":")[0]
                if name:
                    todo.append(name)
    return closure


def alternative_of_base_package(command):
    """True when the command is a Debian alternative (/etc/alternatives) that a package of the
    base system provides (awk: mawk, which every Debian system has)."""
    path = shutil.which(command)
    if not path or not os.path.islink(path) or \
            not os.readlink(path).startswith("/etc/alternatives/"):
        return False
    out = subprocess.run(["update-alternatives", "--list", command], capture_output=True, text=True)
    for candidate in out.stdout.split():
        owner = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        if owner.returncode == 0 and priority_of(owner.stdout.split(":")[0]) in ("required", "important"):
            return True
    return False


def priority_of(package):
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Priority}", package],
                         capture_output=True, text=True)
    return out.stdout.strip()


def main():
    readme = open(os.path.join(REPO, "README.md")).read()
    todo, seen = sorted(script_paths_named(readme)), set()
    texts = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        texts[path] = open(path).read()
        if path.endswith(".sh"):  # the scripts a shell script runs (a Python script runs none)
            todo.extend(script_paths_named(texts[path]) - seen)

    bash = {p: t for p, t in texts.items() if t.startswith("#!/usr/bin/env bash")}
    functions = set().union(*(functions_of(t) for t in bash.values()))
    installed = with_dependencies(set().union(*(installed_packages_named(t) for t in bash.values())))
    # Variables a script sets (ensure_postgres exports INBOX_PG_URL for the scripts it runs).
    assigned = set().union(*(re.findall(r"(?:export\s+|\b)(INBOX_[A-Z0-9_]+)=", t) for t in bash.values()))
    scripts = {os.path.basename(p) for p in texts}
    unmet = []

    for path, text in sorted(bash.items()):
        name = os.path.relpath(path, REPO)
        for command in sorted(commands_of_bash(text)):
            if command in BASH_WORDS or command in functions or command in PREREQUISITES \
                    or command in scripts or command in installed:
                continue
            if alternative_of_base_package(command):
                continue
            package = package_of(command)
            if package is None:
                if command not in installed:
                    unmet.append(f"{name}: runs `{command}`, which is not on this machine and "
                                 "which no script installs")
                continue
            if package.startswith("(not from"):
                # Installed by the scripts themselves (cargo install, a virtualenv): allowed only
                # for what the Rust toolchain's directory holds.
                if os.path.dirname(shutil.which(command)) == os.path.expanduser("~/.cargo/bin"):
                    continue
                unmet.append(f"{name}: runs `{command}` {package}, which no script installs")
                continue
            if priority_of(package) in ("required", "important") or package in installed:
                continue
            unmet.append(f"{name}: runs `{command}` (Debian package {package}, priority "
                         f"{priority_of(package) or 'unknown'}), which no script installs")
        for variable in sorted(inputs_of(text) - assigned):
            if variable not in readme:
                unmet.append(f"{name}: reads the setting {variable}, which the README does not name")
        for match in re.finditer(r"(?<![\w.])(/work/[\w./-]+|\.\./shared/[\w./-]+)", text):
            unmet.append(f"{name}: reads {match.group(1)}, a path of one machine's layout")

    print(f"checked {len(texts)} scripts the README runs: {', '.join(sorted(os.path.relpath(p, REPO) for p in texts))}")
    if unmet:
        print("needs the README does not say how to get:", *unmet, sep="\n  ")
        return 1
    print("every command, setting and file they need is installed by them, part of Debian's base "
          "system, the Rust toolchain's, or named in the README")
    return 0


if __name__ == "__main__":
    sys.exit(main())
