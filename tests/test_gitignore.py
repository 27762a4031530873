"""git's ignore decisions, checked against real git on real repositories.

Every case builds a repository in a temporary folder, scans it with the
core's own scan_tree (with no name rules of its own, so that only git's
count) and compares what the scan leaves out with `git ls-files --others
--ignored --exclude-standard` run in the workspace root, with an empty HOME
and no system config, so only the repository's own rules count; GitView's
answer for each single path must agree. Each case also states the files
git ignores, so a case that stops exercising what it names fails too.
"""

import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import support

sys.path.insert(0, support.SCRIPTS)
import tc as gi  # noqa: E402


class NoNameRules(gi.PathPolicy):
    """A policy that leaves nothing out by name (but git's own folder, which
    every scan leaves out), so what the scan leaves out is git's doing."""

    def excluded_name(self, name):
        return False


def walk(workspace, loaded):
    """(view, files the scan left out: ignored ones and those in ignored
    folders) of workspace, scanned as a save scans it."""
    view = gi.GitView(workspace, loaded)
    scan = gi.scan_tree(workspace, NoNameRules(), git=view)
    return view, set(scan.ignored)


def git_env(home):
    env = gi.git_environment()
    env.update({"HOME": home, "XDG_CONFIG_HOME": home, "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost",
                "GIT_LITERAL_PATHSPECS": "1"})
    return env


class GitRepo:
    """A real repository in a temporary folder (removed after the test)."""

    def __init__(self, test, *, init_args=()):
        self.test = test
        self.home = tempfile.mkdtemp(prefix="tc-gi-home-")
        test.addCleanup(shutil.rmtree, self.home, True)
        self.env = git_env(self.home)
        self.dir = os.path.realpath(tempfile.mkdtemp(prefix="tc-gi-"))
        test.addCleanup(shutil.rmtree, self.dir, True)
        self.git("init", "-q", *init_args)

    def git(self, *args, cwd=None, input=None):
        proc = subprocess.run(["git"] + list(args), cwd=cwd or self.dir, env=self.env,
                              input=input, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if proc.returncode:
            self.test.fail("git %s: %s" % (" ".join(args), proc.stderr.decode("utf-8", "replace")))
        return proc.stdout

    def path(self, rel):
        return os.path.join(os.fsencode(self.dir), os.fsencode(rel))

    def write(self, rel, data=b""):
        full = self.path(rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as fh:
            fh.write(data)

    def track(self, *rels):
        self.git("add", "-f", "--", *[os.fsdecode(os.fsencode(r)) for r in rels])

    def git_ignored(self, workspace):
        out = self.git("ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                       cwd=workspace)
        return {os.fsdecode(p) for p in out.split(b"\0") if p}


def files_on_disk(root):
    out, todo = set(), [""]
    while todo:
        folder = todo.pop()
        with os.scandir(os.path.join(root, folder) if folder else root) as listing:
            for entry in listing:
                if entry.name == ".git":
                    continue
                rel = folder + "/" + entry.name if folder else entry.name
                if entry.is_dir(follow_symlinks=False):
                    todo.append(rel)
                else:
                    out.add(rel)
    return out


class GitCompare:
    """Mixin: build a repository from a case and compare with git."""

    def build(self, case):
        repo = GitRepo(self, init_args=case.get("init", ()))
        for key, value in case.get("config", {}).items():
            repo.git("config", key, value)
        for rel in case.get("files", ()):
            repo.write(rel)
        for rel, data in case.get("ignore", {}).items():
            repo.write(rel, data)
        if "exclude" in case:
            repo.write(".git/info/exclude", case["exclude"])
        if case.get("tracked"):
            repo.track(*case["tracked"])
        for link, target in case.get("links", {}).items():
            os.symlink(target, repo.path(link))
        return repo

    def compare(self, repo, workspace_rel="", expect=None, msg=None):
        workspace = os.path.join(repo.dir, workspace_rel)
        loaded = gi.load_repo_ignores(workspace)
        self.assertIsNotNone(loaded, msg)
        view, ignored = walk(workspace, loaded)
        on_disk = files_on_disk(workspace)
        ours = {rel for rel in on_disk
                if rel in ignored or any(rel.startswith(d) for d in ignored if d.endswith("/"))}
        theirs = repo.git_ignored(workspace)
        self.assertEqual(sorted(ours), sorted(theirs), msg)
        # Each path asked about alone (as a restore asks of its targets) gets
        # the same answer as the walk gave, from a fresh view.
        alone = gi.GitView(workspace, loaded)
        self.assertEqual(sorted(rel for rel in on_disk if alone.ignored(rel)), sorted(ours), msg)
        if expect is not None:
            self.assertEqual(sorted(theirs), sorted(expect), msg)
        return loaded


# name: (case, files git ignores). Files are created empty; "ignore" holds
# the ignore files by path.
CASES = {
    "comments and blank lines": (
        {"ignore": {".gitignore": b"# comment\n\n   \nfoo\n#bar\n"},
         "files": ["foo", "#bar", "bar", "# comment"]},
        {"foo"}),
    "escaped hash": (
        {"ignore": {".gitignore": b"\\#file\n"}, "files": ["#file", "file"]},
        {"#file"}),
    "escaped bang": (
        {"ignore": {".gitignore": b"\\!file\n"}, "files": ["!file", "file"]},
        {"!file"}),
    "trailing spaces": (
        {"ignore": {".gitignore": b"a  \nb\\ \nc\\  \nd \\ \n"},
         "files": ["a", "a  ", "b", "b ", "c", "c ", "c  ", "d", "d  "]},
        {"a", "b ", "c ", "d  "}),
    "crlf lines, bom, nul": (
        {"ignore": {".gitignore": b"\xef\xbb\xbfone\r\ntwo\r\nthr\0ee\n"},
         "files": ["one", "two", "thr", "three"]},
        {"one", "two", "thr"}),
    "no final newline": (
        {"ignore": {".gitignore": b"a\nlast"}, "files": ["a", "last", "b"]},
        {"a", "last"}),
    "negation": (
        {"ignore": {".gitignore": b"*.log\n!keep.log\n"},
         "files": ["a.log", "keep.log", "sub/b.log", "sub/keep.log"]},
        {"a.log", "sub/b.log"}),
    "last match wins": (
        {"ignore": {".gitignore": b"!x.txt\n*.txt\n"}, "files": ["x.txt", "y.txt", "z"]},
        {"x.txt", "y.txt"}),
    "no re-include inside an excluded folder": (
        {"ignore": {".gitignore": b"build/\n!build/keep.txt\n!keep.txt\n"},
         "files": ["build/keep.txt", "build/a", "keep.txt"]},
        {"build/keep.txt", "build/a"}),
    "re-include under folder/*": (
        {"ignore": {".gitignore": b"build/*\n!build/keep/\n"},
         "files": ["build/a", "build/keep/x", "build/keep/y/z"]},
        {"build/a"}),
    "folder-only pattern": (
        {"ignore": {".gitignore": b"cache/\n"},
         "files": ["cache/a", "sub/cache/b", "other/cache"]},
        {"cache/a", "sub/cache/b"}),
    "anchored and unanchored": (
        {"ignore": {".gitignore": b"/root.txt\nany.txt\n"},
         "files": ["root.txt", "sub/root.txt", "any.txt", "sub/any.txt"]},
        {"root.txt", "any.txt", "sub/any.txt"}),
    "middle slash anchors": (
        {"ignore": {".gitignore": b"doc/frotz\n"},
         "files": ["doc/frotz", "a/doc/frotz", "doc/x"]},
        {"doc/frotz"}),
    "a/**/b": (
        {"ignore": {".gitignore": b"a/**/b\n"},
         "files": ["a/b", "a/x/b", "a/x/y/b", "a/xb", "c/a/b", "a/b2"]},
        {"a/b", "a/x/b", "a/x/y/b"}),
    "leading **/": (
        {"ignore": {".gitignore": b"**/foo\n**/p/q\n"},
         "files": ["foo", "x/foo", "x/y/foo", "foox", "p/q", "z/p/q", "p/z/q"]},
        {"foo", "x/foo", "x/y/foo", "p/q", "z/p/q"}),
    "trailing /**": (
        {"ignore": {".gitignore": b"foo/**\n"},
         "files": ["foo/a", "foo/b/c", "foobar", "x/foo/a"]},
        {"foo/a", "foo/b/c"}),
    "** elsewhere is a plain *": (
        {"ignore": {".gitignore": b"a**b\nx/**y\n"},
         "files": ["ab", "axxb", "s/ab", "x/y", "x/ay", "x/a/y"]},
        {"ab", "axxb", "s/ab", "x/y", "x/ay"}),
    "** after a literal prefix": (
        {"ignore": {".gitignore": b"foo**/bar\n"},
         "files": ["foo/bar", "foox/y/bar", "fooz/bar", "foo/x/bar", "foobar", "fo/bar"]},
        {"foo/bar", "foox/y/bar", "fooz/bar", "foo/x/bar", "foobar"}),
    "question mark takes one byte": (
        {"ignore": {".gitignore": b"?.c\n??.h\n"},
         "files": ["a.c", "ab.c", "\u00e9.c", "\u00e9.h", "ab.h"]},
        {"a.c", "\u00e9.h", "ab.h"}),
    "ranges and negated classes": (
        {"ignore": {".gitignore": b"[a-c]x\n[!x]y\n[]z]w\n[a-]v\n"},
         "files": ["ax", "bx", "dx", "Ax", "ay", "xy", "]w", "zw", "-v", "av", "bv"]},
        {"ax", "bx", "ay", "]w", "zw", "-v", "av"}),
    "named classes": (
        {"ignore": {".gitignore": b"a[[:digit:]]\nb[[:upper:][:space:]]\nc[[:bogus:]]\n"},
         "files": ["a1", "ab", "bQ", "b ", "b\t", "b\x0b", "b\x0c", "bq", "c1", "cb"]},
        {"a1", "bQ", "b ", "b\t"}),
    "unterminated bracket": (
        {"ignore": {".gitignore": b"[abc\nz[\n*[\n"}, "files": ["[abc", "a", "z[", "q["]},
        set()),
    "trailing backslash": (
        {"ignore": {".gitignore": b"foo\\\n"}, "files": ["foo\\", "foo"]},
        set()),
    "patterns that match nothing": (
        {"ignore": {".gitignore": b"/\n!\n//\n!/\n\\\n"}, "files": ["a", "b/c"]},
        set()),
    "nested file re-includes": (
        {"ignore": {".gitignore": b"*.txt\n", "sub/.gitignore": b"!keep.txt\n"},
         "files": ["a.txt", "sub/keep.txt", "sub/other.txt", "keep.txt"]},
        {"a.txt", "sub/other.txt", "keep.txt"}),
    "nested file anchors to its folder": (
        {"ignore": {"sub/.gitignore": b"/local\ndeep/x\n"},
         "files": ["sub/local", "local", "sub/x/local", "sub/deep/x", "deep/x"]},
        {"sub/local", "sub/deep/x"}),
    "deeper file wins": (
        {"ignore": {".gitignore": b"!important.log\n", "sub/.gitignore": b"*.log\n"},
         "files": ["important.log", "sub/important.log"]},
        {"sub/important.log"}),
    "a folder's own file does not decide the folder": (
        {"ignore": {".gitignore": b"sub/\n", "sub/.gitignore": b"!*\n"},
         "files": ["sub/a"]},
        {"sub/a", "sub/.gitignore"}),
    "info/exclude ranks lowest": (
        {"exclude": b"secret\nother\n", "ignore": {".gitignore": b"!secret\n"},
         "files": ["secret", "other", "plain"]},
        {"other"}),
    "tracked file matching a rule": (
        {"ignore": {".gitignore": b"*.log\n"}, "files": ["t.log", "u.log"],
         "tracked": ["t.log"]},
        {"u.log"}),
    "tracked files inside an ignored folder": (
        {"ignore": {".gitignore": b"build/\n", "build/.gitignore": b"!u.txt\n"},
         "files": ["build/t.txt", "build/u.txt", "build/sub/v", "build/sub/w"],
         "tracked": ["build/t.txt", "build/sub/w"]},
        {"build/u.txt", "build/sub/v", "build/.gitignore"}),
    "case-sensitive by default": (
        {"ignore": {".gitignore": b"*.LOG\nDir/\n"},
         "files": ["x.log", "X.LOG", "dir/f", "Dir/g"]},
        {"X.LOG", "Dir/g"}),
    "core.ignoreCase": (
        {"config": {"core.ignoreCase": "true"},
         "ignore": {".gitignore": b"*.LOG\nDir/\n[A-C]w\n[A]x\n\\By\nQ*\n/Top/Sub\n"},
         "files": ["x.log", "Y.Log", "dir/f", "DIR/g", "Aw", "bw", "Ax", "ax", "By", "by",
                   "qq", "top/sub", "TOP/SUB"]},
        {"x.log", "Y.Log", "dir/f", "DIR/g", "Aw", "bw", "qq", "top/sub", "TOP/SUB"}),
    "core.ignoreCase and tracked paths": (
        {"config": {"core.ignoreCase": "true"},
         "ignore": {".gitignore": b"*.txt\nd/\n"},
         "files": ["a.txt", "A.TXT", "b.txt", "d/y.txt", "D/x.txt"],
         "tracked": ["a.txt", "d/y.txt"]},
        {"b.txt", "D/x.txt"}),
    "symbolic links are not folders": (
        {"ignore": {".gitignore": b"ldir/\nlname\n"},
         "files": ["real/x"], "links": {"ldir": "real", "lname": "real"}},
        {"lname"}),
    "symlinked .gitignore is not read": (
        {"ignore": {"rules": b"x\n"}, "files": ["x", "y"], "links": {".gitignore": "rules"}},
        set()),
    "non-ASCII names": (
        {"ignore": {".gitignore": "caf\u00e9/\nna\u00efve*\n/\u65e5\u672c/\u8a9e.txt\n".encode()
                    + b"\xff*\n"},
         "files": ["caf\u00e9/x", "cafe/x", "na\u00efve.txt", "naive.txt",
                   "\u65e5\u672c/\u8a9e.txt", "\u65e5\u672c/b.txt",
                   os.fsdecode(b"\xffz"), os.fsdecode(b"\xfe")]},
        {"caf\u00e9/x", "na\u00efve.txt", "\u65e5\u672c/\u8a9e.txt", os.fsdecode(b"\xffz")}),
}


class PatternCases(GitCompare, unittest.TestCase):

    def test_cases(self):
        for name, (case, expect) in CASES.items():
            with self.subTest(name):
                self.compare(self.build(case), expect=expect, msg=name)

    def test_workspace_below_the_top(self):
        repo = self.build({
            "ignore": {".gitignore": b"/mid/ws/built\n*.o\n",
                       "mid/.gitignore": b"ws/only-here\n!ws/keep.o\n",
                       "mid/ws/.gitignore": b"local\n"},
            "exclude": b"from-exclude\n",
            "files": ["mid/ws/built", "mid/ws/a.o", "mid/ws/keep.o", "mid/ws/sub/built",
                      "mid/ws/only-here", "mid/ws/sub/only-here", "mid/ws/local",
                      "mid/ws/from-exclude", "mid/ws/plain", "mid/ws/t.o"],
            "tracked": ["mid/ws/t.o"]})
        loaded = self.compare(repo, "mid/ws", expect={
            "built", "a.o", "only-here", "local", "from-exclude"})
        self.assertEqual(loaded.offset, "mid/ws")
        self.assertTrue(loaded.tracked.has("t.o"))

    def test_workspace_inside_an_ignored_folder(self):
        repo = self.build({"ignore": {".gitignore": b"scratch/\n",
                                      "scratch/ws/.gitignore": b"!*\n"},
                           "files": ["scratch/ws/a", "scratch/ws/t"],
                           "tracked": ["scratch/ws/t"]})
        loaded = self.compare(repo, "scratch/ws", expect={"a", ".gitignore"})
        self.assertTrue(loaded.stack.everything)

    def test_no_repository(self):
        folder = tempfile.mkdtemp(prefix="tc-gi-plain-")
        self.addCleanup(shutil.rmtree, folder, True)
        self.assertIsNone(gi.load_repo_ignores(folder))


class IndexCases(GitCompare, unittest.TestCase):
    """The tracked set, from the index parsed here or from git."""

    def tracked_repo(self, **kwargs):
        repo = GitRepo(self, **kwargs)
        repo.write(".gitignore", b"*.log\nbuild/\n")
        names = ["a.log", "b.txt", "build/t.log", "build/deep/u", "dir/sub/c.log", "\u00e9.log"]
        for rel in names:
            repo.write(rel)
        repo.track(".gitignore", *names)
        for rel in ["new.log", "build/new", "dir/sub/d.log", "dir/e.txt"]:
            repo.write(rel)
        return repo

    def git_entries(self, repo, oid_bytes=20):
        out = repo.git("ls-files", "-s", "-z")
        entries = []
        for line in out.split(b"\0"):
            if line:
                head, path = line.split(b"\t", 1)
                mode, oid, stage = head.split(b" ")
                entries.append((int(mode, 8), oid.decode(), int(stage), path))
        return entries

    def our_entries(self, repo, oid_bytes=20):
        with open(os.path.join(repo.dir, ".git", "index"), "rb") as fh:
            data = fh.read()
        return [(struct.unpack(">I", e.mode)[0], e.oid.hex(), e.stage, e.path)
                for e in gi.index_entries(data, oid_bytes)], data

    def check_parsed(self, repo, version, oid_bytes=20):
        ours, data = self.our_entries(repo, oid_bytes)
        self.assertEqual(struct.unpack_from(">I", data, 4)[0], version)
        self.assertEqual(ours, self.git_entries(repo))
        self.assertEqual(gi.tracked_paths_from_index(data, oid_bytes),
                         [entry[3] for entry in ours])
        self.compare(repo, expect={"new.log", "build/new", "dir/sub/d.log"})

    def test_index_versions(self):
        repo = self.tracked_repo()
        self.check_parsed(repo, 2)
        # Extended flags (intent to add) make git write version 3; stages 1-3 are conflicts.
        repo.write("later.log")
        repo.git("add", "-N", "-f", "later.log")
        blob = repo.git("hash-object", "-w", "--stdin", input=b"x").strip()
        repo.git("update-index", "--index-info",
                 input=b"100644 %s 1\tmerge.log\n100644 %s 3\tmerge.log\n" % (blob, blob))
        repo.write("merge.log")
        self.check_parsed(repo, 3)
        repo.git("update-index", "--index-version", "4")
        self.check_parsed(repo, 4)

    def test_sha256_repository(self):
        repo = self.tracked_repo(init_args=("--object-format=sha256",))
        self.check_parsed(repo, 2, oid_bytes=32)

    def test_split_index_takes_git(self):
        repo = self.tracked_repo()
        repo.git("update-index", "--split-index")
        repo.write("more.log")
        repo.track("more.log")
        with open(os.path.join(repo.dir, ".git", "index"), "rb") as fh:
            data = fh.read()
        self.assertIsNone(gi.tracked_paths_from_index(data, 20))
        loaded = self.compare(repo, expect={"new.log", "build/new", "dir/sub/d.log"})
        self.assertTrue(loaded.tracked.known)
        self.assertTrue(loaded.tracked.has("more.log") and loaded.tracked.has("a.log"))

    def test_sparse_index_takes_git(self):
        repo = self.tracked_repo()
        repo.git("commit", "-q", "-m", "files")
        repo.git("sparse-checkout", "set", "--cone", "dir")
        repo.git("config", "index.sparse", "true")
        repo.git("sparse-checkout", "reapply")
        with open(os.path.join(repo.dir, ".git", "index"), "rb") as fh:
            data = fh.read()
        self.assertIsNone(gi.tracked_paths_from_index(data, 20))
        loaded = gi.load_repo_ignores(repo.dir)
        self.assertTrue(loaded.tracked.has("build/deep/u"))  # outside the cone, still tracked

    def test_damaged_index_takes_git(self):
        repo = self.tracked_repo()
        path = os.path.join(repo.dir, ".git", "index")
        with open(path, "rb") as fh:
            data = fh.read()
        self.assertIsNone(gi.tracked_paths_from_index(data[:-1] + bytes([data[-1] ^ 1]), 20))
        self.assertIsNone(gi.tracked_paths_from_index(data[:40], 20))
        self.assertIsNone(gi.tracked_paths_from_index(b"DIRC" + struct.pack(">II", 9, 0)
                                                      + bytes(20), 20))

    def test_tracked_set_is_cached_by_the_index_stat(self):
        repo = self.tracked_repo()
        cache = gi.GitIgnoreCache()
        first = gi.load_repo_ignores(repo.dir, cache=cache).tracked
        self.assertIs(gi.load_repo_ignores(repo.dir, cache=cache).tracked, first)
        repo.track("new.log")
        second = gi.load_repo_ignores(repo.dir, cache=cache).tracked
        self.assertIsNot(second, first)
        self.assertTrue(second.has("new.log") and not first.has("new.log"))

    def test_linked_worktree(self):
        repo = self.tracked_repo()
        repo.git("commit", "-q", "-m", "files")
        repo.write(".git/info/exclude", b"from-exclude\n")
        other = os.path.join(repo.dir, "..", os.path.basename(repo.dir) + "-wt")
        self.addCleanup(shutil.rmtree, other, True)
        repo.git("worktree", "add", "-q", other)
        with open(os.path.join(other, "from-exclude"), "wb"), \
                open(os.path.join(other, "x.log"), "wb"):
            pass
        loaded = gi.load_repo_ignores(other)
        self.assertEqual(loaded.location.top, os.path.realpath(other))
        self.assertNotEqual(loaded.location.git_dir, loaded.location.common_dir)
        _view, ignored = walk(other, loaded)
        out = repo.git("ls-files", "-z", "-o", "-i", "--exclude-standard", cwd=other)
        theirs = {os.fsdecode(p) for p in out.split(b"\0") if p}
        self.assertEqual(ignored, theirs)
        self.assertEqual(theirs, {"from-exclude", "x.log"})


class ConfigCases(unittest.TestCase):

    def test_config_reading(self):
        values = gi.git_config(
            b"[core]\n\tIgnoreCase = true ; comment\n\tbare\n"
            b'[remote "Origin"]\n\turl = "a;b" # c\n'
            b"[Extensions] objectFormat = sha256\n"
            b"[core.Sub]\nkey = no\n")
        self.assertTrue(gi.config_bool(values["core.ignorecase"]))
        self.assertTrue(gi.config_bool(values["core.bare"]))
        self.assertEqual(values["remote.Origin.url"], "a;b")
        self.assertEqual(values["extensions.objectformat"], "sha256")
        self.assertFalse(gi.config_bool(values["core.sub.key"]))
        self.assertFalse(gi.config_bool(""))
        self.assertTrue(gi.config_bool("2"))


# Random cases: a small alphabet of names and pattern pieces, so that
# patterns hit and miss, negate and nest often.
NAMES = ["a", "b", "ab", "a.c", "B.C", ".h", "x y", "\u00e9", "[a]", "a!b"]
PIECES = ["a", "b", "c", ".c", "*", "**", "?", "[a-c]", "[!a]", "[^B-b]", "[]-]", "[", "]",
          "[[:", "\\", "/", " ", "!", "#", "\\ ", "[[:upper:]]", "[a-]", "x", "B",
          "\u00e9".encode().decode("latin-1"), "\r", "\0"]


def random_pattern(rnd):
    text = "".join(rnd.choice(PIECES) for _ in range(rnd.randint(1, 4)))
    if rnd.random() < 0.25:
        text = "!" + text
    if rnd.random() < 0.2:
        text += "/"
    if rnd.random() < 0.15:
        text = "/" + text
    return text.encode("latin-1")


def random_tree(rnd, count):
    """(folders, files): about count files in folders up to four deep."""
    folders, files = [""], set()
    for _ in range(count * 20):
        if len(files) >= count:
            break
        parent = rnd.choice(folders)
        rel = (parent + "/" if parent else "") + rnd.choice(NAMES)
        if rel in files or rel in folders:
            continue
        if parent.count("/") < 3 and rnd.random() < 0.3:
            folders.append(rel)
        else:
            files.add(rel)
    return [f for f in folders if f], sorted(files)


class RandomCases(GitCompare, unittest.TestCase):

    def test_random_rules_against_git(self):
        rnd = random.Random(20240611)
        for round_ in range(8):
            folders, files = random_tree(rnd, 300)
            ignore = {".gitignore": b"\n".join(random_pattern(rnd) for _ in range(12))}
            for folder in rnd.sample(folders, min(3, len(folders))):
                ignore[folder + "/.gitignore"] = b"\n".join(
                    random_pattern(rnd) for _ in range(5))
            case = {"files": files, "ignore": ignore,
                    "exclude": b"\n".join(random_pattern(rnd) for _ in range(3)),
                    "tracked": rnd.sample(files, min(20, len(files)))}
            if round_ % 3 == 2:
                case["config"] = {"core.ignoreCase": "true"}
            with self.subTest(round=round_, ignore=ignore):
                repo = self.build(case)
                made = [f for f in folders if os.path.isdir(os.path.join(repo.dir, f))]
                workspace = rnd.choice([""] + made) if round_ % 2 else ""
                self.compare(repo, workspace, msg="round %d in %r" % (round_, workspace))


if __name__ == "__main__":
    unittest.main()
