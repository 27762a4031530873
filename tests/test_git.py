"""Git refs for saved steps, through a real server and real repositories.

Each new step becomes `refs/checkpoints/<task_id>/sNNNN`, a commit whose tree
is the step's workspace content. These tests read what was written with
plain git (`ls-tree`, `cat-file`, `rev-list`, `fsck`) and check that the
user's side of the repository (HEAD, branches, index, status, stash) is the
same before and after every save.
"""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import unittest

import support
from support import WorkspaceTest, git, make_git_repo, paths_of, read, snapshot, write

SECRET_MARKERS = (b"env-secret-7f3a9c", b"cloud-credential-51d2e8", b"private-key-90b4aa")
# Names the tool always leaves out of a scan, and sensitive names: never in a tree.
NEVER_IN_TREE = (".git", "node_modules/", ".env", "config/prod_credentials.json", "keys/id_rsa")
REAL_GIT = shutil.which("git")
QUIET = {"GIT_OPTIONAL_LOCKS": "0"}  # our own `git status` must not touch the index


def ref_of(task_id, index):
    return "refs/checkpoints/%s/s%04d" % (task_id, index)


def tree_files(repo, ref):
    """{path: (bytes, git mode)} of every blob in the commit's tree."""
    listing = git(repo, "ls-tree", "-r", "-z", "--full-tree", ref)
    rows = []
    for item in listing.split(b"\0"):
        if item:
            meta, path = item.split(b"\t", 1)
            mode, kind, oid = meta.decode().split()
            rows.append((path.decode(), mode, kind, oid))
    data = git(repo, "cat-file", "--batch",
               input="".join(oid + "\n" for _, _, _, oid in rows).encode())
    out = {}
    for path, mode, kind, oid in rows:
        header, data = data.split(b"\n", 1)
        size = int(header.split()[2])
        out[path] = (data[:size], mode, kind)
        data = data[size + 1:]
    return out


def expected_tree(root, drop=NEVER_IN_TREE):
    """The workspace's files as a tree should hold them: bytes and git mode."""
    out = {}
    for rel, (data, mode) in snapshot(root).items():
        if any(rel == d or (d.endswith("/") and rel.startswith(d)) for d in drop):
            continue
        out[rel] = (data, "100755" if mode & stat.S_IXUSR else "100644", "blob")
    return out


def user_state(repo):
    """Everything of the user's that a save must leave exactly as it was."""
    head = git(repo, "rev-parse", "-q", "--verify", "HEAD", check=False)
    branch = git(repo, "symbolic-ref", "-q", "HEAD", check=False)
    refs = [line for line in git(repo, "for-each-ref", "--format=%(objectname) %(refname)")
            .splitlines() if b" refs/checkpoints/" not in line]
    index_path = git(repo, "rev-parse", "--git-path", "index").decode().strip()
    index_path = os.path.join(repo, index_path)
    index_bytes = None
    if os.path.exists(index_path):
        with open(index_path, "rb") as fh:
            index_bytes = fh.read()
    return {
        "head": head, "branch": branch, "refs": refs,
        "ls-files": git(repo, "ls-files", "-s", "-z"),
        "status": git(repo, "status", "--porcelain", "-z", env=QUIET),
        "stash": git(repo, "stash", "list"),
        "index-file": index_bytes,
    }


def subcommand(call):
    """The git command of a logged call: the first word after the -c options."""
    words = call.split()
    i = 0
    while i < len(words) and words[i] == "-c":
        i += 2
    if i >= len(words):
        return ""
    if words[i] == "hash-object" and "tree" in words[i + 1:]:
        return "hash-object -t tree"
    return words[i]


def rev(repo, name):
    return git(repo, "rev-parse", "--verify", "-q", name, check=False).decode().strip()


def checkpoint_refs(repo):
    out = git(repo, "for-each-ref", "--format=%(refname)", "refs/checkpoints/")
    return out.decode().split()


class GitCase(WorkspaceTest):
    server_env = {"TC_GIT": "on"}

    def start(self, root=None, env=None, name="git steps"):
        srv = self.server(env=env)
        task = srv.ok("tc_init", root=root or self.root, name=name)["task_id"]
        return srv, task

    def assertTreeMatches(self, repo, ref, expected):
        got = tree_files(repo, ref)
        self.assertEqual(sorted(got), sorted(expected), "paths in %s" % ref)
        for path, want in expected.items():
            self.assertEqual(got[path], want, "%s in %s" % (path, ref))

    def make_spy_git(self, on_commit_tree=None):
        """A `git` first on PATH that logs each call, then runs the real git.

        Calls are logged one per line; the stdin of hash-object is appended
        to a second file, so a test can see which paths were hashed.
        `on_commit_tree` is a shell command run once, just before the real
        commit-tree, after arm_spy(): it changes the repository while a
        save is between its two fingerprints.
        """
        spy_dir = os.path.join(self.tmp, "spy-bin")
        self.spy_log = os.path.join(self.tmp, "git-calls.log")
        self.spy_hashed = os.path.join(self.tmp, "git-hashed.log")
        self.spy_trees = os.path.join(self.tmp, "git-trees")
        self.spy_flag = os.path.join(self.tmp, "spy-armed")
        self.spy_action_log = os.path.join(self.tmp, "spy-action.log")
        action = ""
        if on_commit_tree:
            action = (
                "case \" $* \" in *\" commit-tree \"*)\n"
                "  if [ -e '%(flag)s' ]; then rm -f '%(flag)s'\n"
                "    ( %(action)s ) >> '%(alog)s' 2>&1 || echo ACTION-FAILED >> '%(alog)s'\n"
                "  fi;;\n"
                "esac\n"
            ) % {"flag": self.spy_flag, "alog": self.spy_action_log, "action": on_commit_tree}
        script = (
            "#!/bin/sh\n"
            "printf '%%s\\n' \"$*\" >> '%(log)s'\n"
            "case \" $* \" in *\" -t tree \"*)\n"
            "  tmp=$(mktemp '%(scratch)s/stdin.XXXXXX'); cat > \"$tmp\"; mkdir -p '%(trees)s'\n"
            "  while IFS= read -r p; do\n"
            "    cp \"$p\" '%(trees)s'/$(ls '%(trees)s' | wc -l | tr -d ' ')\n"
            "  done < \"$tmp\"\n"
            "  exec '%(git)s' \"$@\" < \"$tmp\";;\n"
            "*\" hash-object \"*)\n"
            "  tmp=$(mktemp '%(scratch)s/stdin.XXXXXX'); cat > \"$tmp\"; cat \"$tmp\" >> '%(hashed)s'\n"
            "  exec '%(git)s' \"$@\" < \"$tmp\";;\n"
            "esac\n"
        ) % {"log": self.spy_log, "hashed": self.spy_hashed, "git": REAL_GIT,
             "trees": self.spy_trees, "scratch": self.tmp}
        script += action + "exec '%s' \"$@\"\n" % REAL_GIT
        write(spy_dir, "git", script, mode=0o755)
        return {"PATH": spy_dir + os.pathsep + os.environ.get("PATH", "")}

    def arm_spy(self):
        """The next commit-tree runs the spy's action first."""
        write(self.tmp, "spy-armed", "")

    def spy_action_output(self):
        if not os.path.exists(self.spy_action_log):
            return ""
        with open(self.spy_action_log, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def spy_calls(self):
        if not os.path.exists(self.spy_log):
            return []
        with open(self.spy_log, encoding="utf-8") as fh:
            return fh.read().splitlines()

    def spy_tree_input(self):
        """The body of every tree object written so far, in order."""
        if not os.path.isdir(self.spy_trees):
            return []
        bodies = []
        for number in range(len(os.listdir(self.spy_trees))):
            with open(os.path.join(self.spy_trees, str(number)), "rb") as fh:
                bodies.append(fh.read())
        return bodies

    def spy_hashed_lines(self):
        if not os.path.exists(self.spy_hashed):
            return []
        with open(self.spy_hashed, encoding="utf-8") as fh:
            return fh.read().splitlines()


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class StoreLeftAloneByGitTest(GitCase):
    """The default store sits inside the repository: the user's git commands
    must neither pick it up nor take it away."""

    def untracked(self):
        return git(self.root, "status", "--porcelain", "--untracked-files=all").decode()

    def test_status_add_stash_and_clean_leave_the_store_alone(self):
        make_git_repo(self.root)
        srv, _task = self.start()
        self.write("notes.txt", "one\n")
        srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(self.untracked(), "?? notes.txt\n")
        git(self.root, "stash", "push", "-u", "-q")  # takes untracked files off the disk
        self.assertFalse(os.path.exists(os.path.join(self.root, "notes.txt")))
        self.assertTrue(os.path.isfile(os.path.join(self.store, "state.lock")))
        git(self.root, "stash", "pop", "-q")
        git(self.root, "clean", "-f", "-d", "-q")  # removes untracked files and folders
        self.assertFalse(os.path.exists(os.path.join(self.root, "notes.txt")))
        git(self.root, "add", "-A")
        self.assertNotIn(".checkpoints", git(self.root, "ls-files", "--cached").decode())
        resumed = srv.ok("tc_resume", root=self.root)
        self.assertTrue(resumed["health"]["ok"], resumed["health"])
        self.assertEqual(resumed["drift_paths"], ["notes.txt"])  # git clean removed it
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(self.read("notes.txt"), b"one\n")

    def test_an_existing_ignore_file_is_kept_and_a_removed_one_comes_back(self):
        make_git_repo(self.root)
        srv, _task = self.start()
        ignore = os.path.join(self.store, ".gitignore")
        os.unlink(ignore)
        self.assertIn("?? .checkpoints/", self.untracked())
        srv.ok("tc_save", root=self.root, title="one")
        self.assertNotIn(".checkpoints", self.untracked())
        open(ignore, "w").close()  # what a power cut can leave of it
        self.assertIn("?? .checkpoints/", self.untracked())
        srv.ok("tc_capture", root=self.root)
        self.assertNotIn(".checkpoints", self.untracked())
        write(self.store, ".gitignore", "payload/\n")  # the user's own rules
        srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(read(self.store, ".gitignore"), b"payload/\n")


@unittest.skipIf(REAL_GIT is None, "git is not installed")
@unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
class ProgressTest(GitCase):
    """A slow git makes a save take seconds: a call that asked for progress
    hears from the server until its answer; one that did not hears nothing."""

    def call_and_listen(self, srv, msg_id, arguments, meta=None):
        params = {"name": "tc_save", "arguments": arguments}
        if meta is not None:
            params["_meta"] = meta
        srv.send_raw((json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": "tools/call",
                                  "params": params}) + "\n").encode("utf-8"))
        notices = []
        while True:
            message = srv.read_line()
            if message.get("id") == msg_id:
                return notices, message
            notices.append(message)

    def test_progress_until_the_answer_only_when_asked(self):
        make_git_repo(self.root)
        srv, _task = self.start(env=self.make_spy_git(on_commit_tree="sleep 1.6"))
        self.write("a.txt", "one\n")
        self.arm_spy()
        notices, reply = self.call_and_listen(srv, "slow-1", {"root": self.root, "title": "one"},
                                              {"progressToken": "save-1"})
        self.assertEqual(reply["result"]["structuredContent"]["index"], 1, reply)
        self.assertTrue(reply["result"]["structuredContent"]["git"]["ok"], reply)
        self.assertGreaterEqual(len(notices), 1, "no progress during a 1.6 s save")
        for notice in notices:
            self.assertEqual(notice["method"], "notifications/progress", notice)
            self.assertNotIn("id", notice)
            self.assertEqual(notice["params"]["progressToken"], "save-1")
            self.assertIn("tc_save", notice["params"]["message"])
        values = [n["params"]["progress"] for n in notices]
        self.assertEqual(values, sorted(set(values)), "progress must grow with every notice")
        self.write("a.txt", "two\n")
        self.arm_spy()
        notices, reply = self.call_and_listen(srv, "slow-2", {"root": self.root, "title": "two"})
        self.assertEqual(reply["result"]["structuredContent"]["index"], 2, reply)
        self.assertEqual(notices, [])
        self.assertEqual(srv.request("ping")["result"], {})  # nothing left in between


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class StepRefsTest(GitCase):
    """Three saves in a repository with every kind of user state."""

    def prepare_repository(self):
        make_git_repo(self.root)
        self.write(".gitignore", "debug.log\n")
        self.write("src/app.py", "print('v1')\n")
        git(self.root, "add", ".gitignore", "src/app.py")
        git(self.root, "commit", "-q", "-m", "base")
        git(self.root, "branch", "feature")
        self.write("README.txt", "stashed edit\n")
        git(self.root, "stash", "-q")
        self.write("src/app.py", "print('v2 staged')\n")
        git(self.root, "add", "src/app.py")
        self.write("README.txt", "hello\nunstaged edit\n")
        self.write("notes/todo.md", "untracked\n")
        self.write("debug.log", "ignored by git\n")
        self.write("tools/run.sh", "#!/bin/sh\necho run\n", mode=0o755)
        self.write(".env", b"TOKEN=" + SECRET_MARKERS[0] + b"\n")
        self.write("config/prod_credentials.json", b'{"k": "%s"}' % SECRET_MARKERS[1])
        self.write("keys/id_rsa", SECRET_MARKERS[2])
        self.write("node_modules/pkg/index.js", "module.exports = 1;\n")

    def change_workspace(self, step):
        if step == 2:
            self.write("notes/todo.md", "untracked, edited\n")
            self.write("src/new_module.py", "x = 2\n")
            self.write("assets/blob.bin", bytes(range(256)) * 8)
        elif step == 3:
            os.remove(os.path.join(self.root, "debug.log"))
            os.chmod(os.path.join(self.root, "notes/todo.md"), 0o755)
            self.write(".env", b"TOKEN=" + SECRET_MARKERS[0] + b"-rotated\n")

    def test_three_saves_make_three_refs_and_leave_the_user_repo_alone(self):
        self.prepare_repository()
        srv, task = self.start()
        expected = {}
        for step in (1, 2, 3):
            self.change_workspace(step)
            # debug.log is what the repository's .gitignore ignores: left out.
            expected[step] = expected_tree(self.root, drop=NEVER_IN_TREE + ("debug.log",))
            before = user_state(self.root)
            result = srv.ok("tc_save", root=self.root, title="step %d" % step,
                            conclusion="done %d" % step, next="go on")
            self.assertEqual(user_state(self.root), before, "user repository after step %d" % step)
            self.assertEqual(result["index"], step)
            self.assertEqual(result["git"]["ok"], True, result["git"])
            self.assertEqual(result["git"]["ref"], ref_of(task, step))
            self.assertIsNone(result["git"]["reason"])
            self.assertIs(result["git"]["unchanged"], True)
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, i) for i in (1, 2, 3)])
        for step in (1, 2, 3):
            self.assertTreeMatches(self.root, ref_of(task, step), expected[step])
        self.check_history(task)
        self.check_no_secret_in_objects()
        fsck = subprocess.run([REAL_GIT, "fsck", "--no-dangling"], cwd=self.root,
                              env=support.clean_env(), capture_output=True)
        self.assertEqual(fsck.returncode, 0, fsck.stderr)
        self.check_sharing_with_plain_git(task)

    def check_history(self, task):
        commits = [git(self.root, "rev-parse", ref_of(task, i)).decode().strip() for i in (1, 2, 3)]
        walked = git(self.root, "rev-list", ref_of(task, 3)).decode().split()
        self.assertEqual(walked, commits[::-1], "git log walks the task's steps")
        author = git(self.root, "log", "--format=%an <%ae>|%cn <%ce>|%B", ref_of(task, 3))
        self.assertIn(b"step 3", author)
        identities = {line.split(b"|")[0] for line in
                      git(self.root, "log", "--format=%an <%ae>|%cn <%ce>", ref_of(task, 3)).splitlines()}
        self.assertEqual(len(identities), 1, identities)
        self.assertNotIn(b"Test", identities.pop(), "the user's identity is not used")

    def check_no_secret_in_objects(self):
        everything = git(self.root, "cat-file", "--batch-all-objects", "--batch")
        for marker in SECRET_MARKERS:
            self.assertNotIn(marker, everything)

    def check_sharing_with_plain_git(self, task):
        remote = os.path.join(self.tmp, "remote.git")
        git(self.tmp, "init", "-q", "--bare", remote)
        git(self.root, "push", "-q", remote, "refs/checkpoints/*:refs/checkpoints/*")
        self.assertEqual(checkpoint_refs(remote), [ref_of(task, i) for i in (1, 2, 3)])
        self.assertEqual(git(remote, "cat-file", "blob", ref_of(task, 2) + ":src/new_module.py"),
                         b"x = 2\n")
        diff = git(self.root, "diff", "--name-only", ref_of(task, 2), ref_of(task, 3))
        changed = [b"notes/todo.md"]  # (debug.log, which git ignores, is in neither)
        if not support.keeps_mode_bits():  # no executable bit: step 3 left todo.md as it was
            changed.remove(b"notes/todo.md")
        self.assertEqual(diff.split(), changed)


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class RepositoryShapesTest(GitCase):
    """Empty repository, subdirectory workspace, `.git` file (worktree)."""

    def test_repository_without_any_commit(self):
        make_git_repo(self.root, commit=False)
        self.write("first.txt", "first\n")
        self.write("bin/tool", "#!/bin/sh\n", mode=0o755)
        srv, task = self.start()
        before = user_state(self.root)
        result = srv.ok("tc_save", root=self.root, title="first")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertIs(result["git"]["unchanged"], True)
        self.assertEqual(user_state(self.root), before)
        self.assertEqual(before["head"], b"", "HEAD is still unborn")
        self.assertTreeMatches(self.root, ref_of(task, 1), expected_tree(self.root))
        self.assertEqual(git(self.root, "rev-list", "--all").split(),
                         [git(self.root, "rev-parse", ref_of(task, 1)).strip()])

    def test_workspace_in_a_subdirectory_is_the_tree_root(self):
        repo = os.path.join(self.tmp, "repo")
        os.makedirs(repo)
        make_git_repo(repo)
        workspace = os.path.join(repo, "packages", "app")
        write(workspace, "main.py", "print('app')\n")
        write(workspace, "lib/util.py", "U = 1\n")
        git(repo, "add", "packages")
        git(repo, "commit", "-q", "-m", "app")
        write(workspace, "lib/util.py", "U = 2\n")
        srv, task = self.start(root=workspace)
        before = user_state(repo)
        result = srv.ok("tc_save", root=workspace, title="edit util")
        self.assertEqual(user_state(repo), before)
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(checkpoint_refs(repo), [ref_of(task, 1)])
        self.assertTreeMatches(repo, ref_of(task, 1), expected_tree(workspace))
        self.assertIs(result["git"]["unchanged"], True)

    def test_worktree_with_a_git_file(self):
        repo = os.path.join(self.tmp, "repo")
        os.makedirs(repo)
        make_git_repo(repo)
        git(repo, "worktree", "add", "-q", "-b", "side", self.root)
        self.assertTrue(os.path.isfile(os.path.join(self.root, ".git")))
        self.write("side.txt", "side work\n")
        srv, task = self.start()
        before = user_state(self.root), user_state(repo)
        result = srv.ok("tc_save", root=self.root, title="side")
        self.assertEqual((user_state(self.root), user_state(repo)), before)
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertIs(result["git"]["unchanged"], True)
        self.assertEqual(checkpoint_refs(repo), [ref_of(task, 1)], "refs are shared by worktrees")
        self.assertTreeMatches(repo, ref_of(task, 1), expected_tree(self.root))

    def test_deeper_git_folders_and_files_are_never_in_a_step_or_its_tree(self):
        make_git_repo(self.root)
        inner = os.path.join(self.root, "vendor", "lib")
        os.makedirs(inner)
        make_git_repo(inner)  # a repository of its own inside the work tree
        self.write("mod/.git", "gitdir: ../.git/modules/mod\n")  # how a submodule points
        self.write("mod/code.py", "x = 1\n")
        self.write("tools/.checkpoints/old.json", "{}\n")
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="nested")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        files = paths_of(srv.ok("tc_show", root=self.root, index=1)["steps"][0]["files"])
        self.assertIn("mod/code.py", files)
        own = [p for p in files if ".git" in p.split("/") or ".checkpoints" in p.split("/")]
        self.assertEqual(own, [])
        tree = tree_files(self.root, ref_of(task, 1))
        self.assertIn("mod/code.py", tree)
        self.assertEqual([p for p in tree if ".git" in p.split("/")], [])
        fsck = subprocess.run([REAL_GIT, "fsck", "--no-dangling", "--full"], cwd=self.root,
                              env=support.clean_env(), capture_output=True)
        self.assertEqual(fsck.returncode, 0, fsck.stderr)

    def test_not_a_repository(self):
        self.write("a.txt", "plain\n")
        srv, _task = self.start()
        result = srv.ok("tc_save", root=self.root, title="plain")
        # Nothing went wrong: there is simply no repository to put a ref in.
        self.assertEqual(result["git"]["ok"], True)
        self.assertEqual(result["git"]["reason"], "not a git repo")
        self.assertIsNone(result["git"]["ref"])
        self.assertFalse(os.path.exists(os.path.join(self.root, ".git")))


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class RefusalsAndFailuresTest(GitCase):
    """No ref is overwritten, and git trouble never fails or undoes a save."""

    def test_existing_ref_is_never_overwritten(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, task = self.start()
        head = git(self.root, "rev-parse", "HEAD").strip()
        git(self.root, "update-ref", ref_of(task, 1), head.decode())
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["index"], 1)
        self.assertEqual(result["git"]["ok"], False)
        self.assertEqual(result["git"]["reason"], "ref exists")
        self.assertEqual(git(self.root, "rev-parse", ref_of(task, 1)).strip(), head)
        shown = srv.ok("tc_show", root=self.root)
        self.assertEqual([s.get("title") for s in shown["steps"]], ["one"])
        self.write("a.txt", "b\n")
        second = srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(second["git"]["ref"], ref_of(task, 2), second["git"])

    def test_a_tree_file_that_cannot_be_removed_costs_no_ref_and_is_swept(self):
        if not shutil.which("strace"):
            self.skipTest("needs strace")
        make_git_repo(self.root)
        self.write("src/a.txt", "a\n")
        srv, task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        self.write("src/a.txt", "b\n")
        # Every unlink of the server's main thread (where refs are written) is refused.
        command = ["strace", "-qq", "-o", os.devnull, "-e", "trace=unlink,unlinkat",
                   "-e", "inject=unlink,unlinkat:error=EROFS"] + list(support.SERVER_COMMAND)
        refused = self.server(command=command)
        two = refused.ok("tc_save", root=self.root, title="two")
        self.assertEqual(two["git"]["ref"], ref_of(task, 2), two["git"])
        git_dir = os.path.join(self.store, "git")
        self.assertTrue([n for n in os.listdir(git_dir) if n.startswith(".tmp-tree-")],
                        "the injected refusal did not reach the tree files")
        self.write("src/a.txt", "c\n")
        three = srv.ok("tc_save", root=self.root, title="three")
        self.assertEqual(three["git"]["ref"], ref_of(task, 3), three["git"])
        self.assertEqual([n for n in os.listdir(git_dir) if n.startswith(".tmp-")], [])

    def test_a_title_with_a_nul_still_gets_its_ref(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, task = self.start()
        saved = srv.ok("tc_save", root=self.root, title="ran tests\x00 output")
        self.assertEqual(saved["git"]["ref"], ref_of(task, 1), saved["git"])
        message = git(self.root, "log", "-1", "--format=%B", ref_of(task, 1))
        self.assertIn(b"ran tests\\0 output", message)

    def test_idempotent_save_and_close_make_no_ref(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, task = self.start()
        first = srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        again = srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        self.assertTrue(again["idempotent"])
        self.assertEqual(again["git"]["ok"], False)
        self.assertEqual(again["git"]["reason"], "no new step")
        self.assertEqual(checkpoint_refs(self.root), [first["git"]["ref"]])
        closed = srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n",
                        close=True)
        self.assertTrue(closed["closed"])
        self.assertEqual(closed["git"]["reason"], "no new step")
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, 1)])

    def test_locked_ref_is_reported_and_the_save_stands(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, task = self.start()
        lock = os.path.join(self.root, ".git", *ref_of(task, 1).split("/")) + ".lock"
        os.makedirs(os.path.dirname(lock))
        open(lock, "w").close()
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["index"], 1)
        self.assertEqual(result["git"]["ok"], False)
        self.assertIn("lock", result["git"].get("error", ""))
        self.assertEqual(checkpoint_refs(self.root), [])
        os.remove(lock)
        self.write("a.txt", "b\n")
        second = srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(second["git"]["ref"], ref_of(task, 2), second["git"])
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 2) + ":a.txt"), b"b\n")

    def test_git_missing_from_path_degrades_to_a_reason(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        empty_bin = os.path.join(self.tmp, "empty-bin")
        os.makedirs(empty_bin)
        srv, _task = self.start(env={"PATH": empty_bin})
        result = srv.call("tc_save", root=self.root, title="one")
        self.assertFalse(result.is_error, result.text)
        self.assertEqual(result["index"], 1)
        self.assertEqual(result["git"]["ok"], False)
        self.assertIsNone(result["git"]["ref"])
        self.assertTrue(result["git"]["reason"], result["git"])
        self.assertEqual(checkpoint_refs(self.root), [])

    @unittest.skipUnless(os.name == "posix", "the stand-in git is a shell script")
    def test_a_git_that_never_finishes_is_stopped(self):
        # A git stuck on a dead mount under .git: stopped after GIT_TIMEOUT
        # with a reason, not waited for forever.
        sys.path.insert(0, support.SCRIPTS)
        import tc
        fake_bin = os.path.join(self.tmp, "hung-bin")
        os.makedirs(fake_bin)
        write(fake_bin, "git", "#!/bin/sh\nexec %s 60\n" % shutil.which("sleep"), mode=0o755)
        runner = tc._GitRunner(self.root, os.path.join(self.tmp, "store"),
                               dict(os.environ, PATH=fake_bin))
        saved = tc.GIT_TIMEOUT
        tc.GIT_TIMEOUT = 0.5
        self.addCleanup(setattr, tc, "GIT_TIMEOUT", saved)
        started = time.monotonic()
        with self.assertRaises(tc.GitCommandFailed) as caught:
            runner.run(["rev-parse", "--git-dir"])
        self.assertLess(time.monotonic() - started, 30)
        self.assertIn("did not finish", str(caught.exception))

    def test_big_file_is_not_in_the_tree(self):
        make_git_repo(self.root)
        self.write("small.txt", "small\n")
        with open(os.path.join(self.root, "huge.img"), "wb") as fh:
            fh.truncate(100 * 1024 * 1024 + 1)
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="big")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertNotIn("huge.img", tree_files(self.root, ref_of(task, 1)))
        self.assertIn("small.txt", tree_files(self.root, ref_of(task, 1)))


# The processes of a save that makes a ref with new content, in a repository
# whose refs are files: the fingerprint is read from files, not from git.
PLUMBING_ONLY = ["rev-parse", "hash-object", "hash-object -t tree",
                 "commit-tree", "update-ref"]


@unittest.skipIf(REAL_GIT is None, "git is not installed")
@unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
class SaveCutOffBeforeItsRefTest(GitCase):
    """A server killed after a save recorded its step and before git made
    the step's ref: the next save writes the missing ref."""

    def cut_off_second_save(self, env=None):
        make_git_repo(self.root)
        self.write("a.txt", "one\n")
        reached, hold = (os.path.join(self.tmp, name) for name in ("reached", "hold"))
        write(self.tmp, "hold", "")
        env = dict(env or {}, **self.make_spy_git(
            on_commit_tree="touch '%s'; while [ -e '%s' ]; do sleep 0.02; done" % (reached, hold)))
        srv, task = self.start(env=env)
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        self.arm_spy()
        srv.send_raw((json.dumps({"jsonrpc": "2.0", "id": 90, "method": "tools/call", "params": {
            "name": "tc_save", "arguments": {"root": self.root, "title": "two",
                                             "conclusion": "c", "next": "n"}}}) + "\n").encode())
        deadline = time.monotonic() + 30
        while not os.path.exists(reached) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertTrue(os.path.exists(reached), "the save never reached commit-tree")
        srv.kill()
        os.remove(hold)
        store = (env or {}).get("TC_STORE", self.store)
        self.assertTrue(os.path.exists(os.path.join(store, "tasks", task, "steps",
                                                    "s0002.json")))
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, 1)])
        return task

    def test_saving_the_same_step_again_writes_its_ref(self):
        task = self.cut_off_second_save()
        srv = self.server()
        again = srv.ok("tc_save", root=self.root, title="two", conclusion="c", next="n")
        self.assertTrue(again["idempotent"])
        self.assertEqual(again["index"], 2)
        self.assertEqual(again["git"]["ref"], ref_of(task, 2), again["git"])
        self.assertTrue(again["git"]["ok"])
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 2) + ":a.txt"), b"two\n")
        self.assertEqual(rev(self.root, ref_of(task, 2) + "^"), rev(self.root, ref_of(task, 1)))
        # Once written, a repeat is the usual "no new step".
        third = srv.ok("tc_save", root=self.root, title="two", conclusion="c", next="n")
        self.assertEqual(third["git"]["reason"], "no new step")

    def test_a_save_of_another_task_first_does_not_use_up_the_check(self):
        # Two workspaces share a store; the server that finds the dead
        # writer saves the other workspace's task first.
        shared = {"TC_STORE": os.path.join(self.tmp, "shared-store")}
        task = self.cut_off_second_save(env=shared)
        other = os.path.join(self.tmp, "other")
        write(other, "b.txt", "b\n")
        srv = self.server(env=shared)
        srv.ok("tc_init", root=other, name="other workspace")
        srv.ok("tc_save", root=other, title="other one")
        self.write("a.txt", "three\n")
        srv.ok("tc_save", root=self.root, title="three")
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, n) for n in (1, 2, 3)])

    def test_another_process_finding_the_dead_writer_first_does_not_use_up_the_check(self):
        # A client's session-start hook takes the lock before any server.
        task = self.cut_off_second_save()
        event = json.dumps({"hook_event_name": "SessionStart", "cwd": self.root})
        hook = subprocess.run(list(support.SERVER_COMMAND) + ["hook", "session-start"],
                              input=event.encode(), capture_output=True, timeout=30,
                              env=support.clean_env({"TC_GIT": "on"}))
        self.assertEqual(hook.returncode, 0, hook.stderr)
        srv = self.server()
        self.write("a.txt", "three\n")
        srv.ok("tc_save", root=self.root, title="three")
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, n) for n in (1, 2, 3)])
        self.assertFalse(os.path.exists(os.path.join(self.store, "git", "unchecked.json")))

    def test_without_a_dead_writer_a_missing_ref_stays_missing(self):
        # A ref the user deleted, or one of a step saved with TC_GIT=off, is
        # not written again by later saves.
        make_git_repo(self.root)
        self.write("a.txt", "one\n")
        srv, task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        git(self.root, "update-ref", "-d", ref_of(task, 1))
        self.write("a.txt", "two\n")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["git"]["ref"],
                         ref_of(task, 2))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["git"]["reason"],
                         "no new step")
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, 2)])

    def test_the_next_step_writes_the_missing_ref_first(self):
        task = self.cut_off_second_save()
        srv = self.server()
        self.write("a.txt", "three\n")
        third = srv.ok("tc_save", root=self.root, title="three")
        self.assertEqual(third["index"], 3)
        self.assertEqual(third["git"]["ref"], ref_of(task, 3))
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, n) for n in (1, 2, 3)])
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 2) + ":a.txt"), b"two\n")
        self.assertEqual(rev(self.root, ref_of(task, 3) + "^"), rev(self.root, ref_of(task, 2)))
        self.assertEqual(rev(self.root, ref_of(task, 2) + "^"), rev(self.root, ref_of(task, 1)))
        git(self.root, "fsck", "--full", "--no-progress")


@unittest.skipIf(REAL_GIT is None, "git is not installed")
@unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
class FingerprintTest(GitCase):
    """git.unchanged: what it proves, what it costs, what it must not confuse."""

    def edit(self, title, root=None):
        """A new file, so that the next save makes a new step."""
        write(root or self.root, "edits/%s.txt" % title.replace(" ", "-"),
              "edit for %s\n" % title)

    def save(self, srv, title, root=None, edit=True):
        """tc_save (after a fresh edit unless edit=False); returns
        (git result, the git commands it ran)."""
        if edit:
            self.edit(title, root)
        calls = len(self.spy_calls())
        result = srv.ok("tc_save", root=root or self.root, title=title)
        return result["git"], [subcommand(c) for c in self.spy_calls()[calls:]]

    def prepare_busy_repository(self):
        """A branch, a tag, two stashes, a staged edit, an untracked file."""
        make_git_repo(self.root)
        git(self.root, "commit", "-q", "--allow-empty", "-m", "second")
        git(self.root, "branch", "feature", "HEAD~1")
        git(self.root, "tag", "-a", "-m", "release", "v1", "HEAD~1")
        for text in ("first stash\n", "second stash\n"):
            self.write("README.txt", text)
            git(self.root, "stash", "-q")
        self.write("staged.txt", "staged\n")
        git(self.root, "add", "staged.txt")
        self.write("late.txt", "not in the index yet\n")

    def test_verify_runs_no_status_ls_files_or_stash_process(self):
        self.prepare_busy_repository()
        srv, task = self.start(env=self.make_spy_git())
        for step in (1, 2):
            self.edit("step %d" % step)
            before = user_state(self.root)
            result, commands = self.save(srv, "step %d" % step, edit=False)
            self.assertEqual(user_state(self.root), before)
            self.assertEqual(result["ref"], ref_of(task, step), result)
            self.assertIs(result["unchanged"], True, result)
            self.assertEqual(commands, PLUMBING_ONLY, "git processes of save %d" % step)
        self.assertEqual(rev(self.root, ref_of(task, 2) + "^"), rev(self.root, ref_of(task, 1)))

    def start_with_action(self, action, **kwargs):
        """A server whose git runs `action` (shell, in the workspace) inside
        the next save that is armed, between the two fingerprints."""
        srv, task = self.start(env=self.make_spy_git(on_commit_tree=action), **kwargs)
        return srv, task

    def assertChangedDuringSave(self, srv, task, step, root=None):
        """An armed save: ref written, unchanged false; then an unarmed one: true."""
        root = root or self.root
        self.arm_spy()
        result, commands = self.save(srv, "armed %d" % step, root=root)
        self.assertFalse(os.path.exists(self.spy_flag), "the action did not run")
        self.assertNotIn("ACTION-FAILED", self.spy_action_output())
        self.assertEqual(result["ok"], True, result)
        self.assertEqual(result["ref"], ref_of(task, step))
        self.assertIn(ref_of(task, step), checkpoint_refs(root))
        self.assertTrue(rev(root, ref_of(task, step) + "^{tree}"))
        self.assertIs(result["unchanged"], False, "the repository changed during the save")
        self.assertIn("commit-tree", commands)
        calm, _ = self.save(srv, "calm %d" % (step + 1), root=root)
        self.assertEqual(calm["ref"], ref_of(task, step + 1))
        self.assertIs(calm["unchanged"], True, "an unchanged repository reads as unchanged")

    def test_branch_moved_during_the_save_reads_as_changed(self):
        self.prepare_busy_repository()
        first = rev(self.root, "HEAD~1")
        srv, task = self.start_with_action(
            "'%s' update-ref refs/heads/main %s" % (REAL_GIT, first))
        self.assertNotEqual(rev(self.root, "refs/heads/main"), first)
        self.assertChangedDuringSave(srv, task, 1)
        self.assertEqual(rev(self.root, "refs/heads/main"), first)

    def test_branch_that_is_not_checked_out_is_watched_too(self):
        self.prepare_busy_repository()
        git(self.root, "pack-refs", "--all")
        self.assertFalse(os.path.exists(os.path.join(self.root, ".git", "refs", "heads", "feature")))
        srv, task = self.start_with_action("'%s' branch -q -f feature main" % REAL_GIT)
        self.assertChangedDuringSave(srv, task, 1)
        self.assertEqual(rev(self.root, "feature"), rev(self.root, "main"))

    def test_index_changed_during_the_save_reads_as_changed(self):
        self.prepare_busy_repository()
        srv, task = self.start_with_action("'%s' add late.txt" % REAL_GIT)
        self.assertNotIn(b"late.txt", git(self.root, "ls-files"))
        self.assertChangedDuringSave(srv, task, 1)
        self.assertIn(b"late.txt", git(self.root, "ls-files"))
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 1) + ":late.txt"),
                         b"not in the index yet\n")

    def test_stash_entry_dropped_during_the_save_reads_as_changed(self):
        self.prepare_busy_repository()
        srv, task = self.start_with_action("'%s' stash drop -q 'stash@{1}'" % REAL_GIT)
        stash_ref = rev(self.root, "refs/stash")
        self.assertEqual(len(git(self.root, "stash", "list").splitlines()), 2)
        self.assertChangedDuringSave(srv, task, 1)
        # Only the stash reflog changed: refs/stash still names the same commit.
        self.assertEqual(rev(self.root, "refs/stash"), stash_ref)
        self.assertEqual(len(git(self.root, "stash", "list").splitlines()), 1)

    def test_pack_refs_during_the_save_is_no_change(self):
        self.prepare_busy_repository()
        srv, task = self.start_with_action("'%s' pack-refs --all" % REAL_GIT)
        loose_main = os.path.join(self.root, ".git", "refs", "heads", "main")
        self.assertTrue(os.path.exists(loose_main))
        self.edit("packed")
        before = user_state(self.root)
        self.arm_spy()
        result, _ = self.save(srv, "packed", edit=False)
        self.assertFalse(os.path.exists(self.spy_flag), "the action did not run")
        self.assertFalse(os.path.exists(loose_main), "pack-refs ran")
        self.assertIn(b" refs/heads/main\n", read(self.root, ".git/packed-refs"))
        self.assertEqual(result["ref"], ref_of(task, 1), result)
        self.assertIs(result["unchanged"], True, result)
        self.assertEqual(user_state(self.root), before)

    def test_index_stat_refresh_during_the_save_is_no_change(self):
        # What an editor's `git status` does while the agent saves: the index
        # file is rewritten with fresh stat data, its entries stay the same.
        self.prepare_busy_repository()
        # touch -t, as POSIX has it (-d @seconds is GNU only: not on macOS).
        srv, task = self.start_with_action(
            "touch -t 200109090146.40 README.txt && GIT_OPTIONAL_LOCKS=1 '%s' update-index -q "
            "--refresh" % REAL_GIT)
        self.edit("refreshed")
        index_before = read(self.root, ".git/index")
        entries_before = git(self.root, "ls-files", "-s")
        self.arm_spy()
        result, _ = self.save(srv, "refreshed", edit=False)
        self.assertFalse(os.path.exists(self.spy_flag), "the action did not run")
        self.assertNotIn("ACTION-FAILED", self.spy_action_output())
        self.assertNotEqual(read(self.root, ".git/index"), index_before, "the index was rewritten")
        self.assertEqual(git(self.root, "ls-files", "-s"), entries_before)
        self.assertEqual(result["ref"], ref_of(task, 1), result)
        self.assertIs(result["unchanged"], True, result)

    def test_pack_refs_between_saves(self):
        self.prepare_busy_repository()
        srv, task = self.start(env=self.make_spy_git())
        first, _ = self.save(srv, "one")
        self.assertIs(first["unchanged"], True, first)
        git(self.root, "pack-refs", "--all")
        loose = os.path.join(self.root, ".git", *ref_of(task, 1).split("/"))
        self.assertFalse(os.path.exists(loose), "s0001 now lives in packed-refs only")
        second, commands = self.save(srv, "two")
        self.assertEqual(second["ok"], True, second)
        self.assertEqual(second["ref"], ref_of(task, 2))
        self.assertIs(second["unchanged"], True, second)
        self.assertEqual(commands, PLUMBING_ONLY)
        # The parent was found in packed-refs.
        self.assertEqual(rev(self.root, ref_of(task, 2) + "^"), rev(self.root, ref_of(task, 1)))
        # A packed ref of the task is never overwritten, and is seen
        # without even trying to write it.
        head = rev(self.root, "HEAD")
        git(self.root, "update-ref", ref_of(task, 3), head)
        git(self.root, "pack-refs", "--all")
        third, commands = self.save(srv, "three")
        self.assertEqual(third["reason"], "ref exists", third)
        self.assertEqual(commands, ["rev-parse"])
        self.assertEqual(rev(self.root, ref_of(task, 3)), head)
        self.assertIs(third["unchanged"], True, third)

    def test_linked_worktree(self):
        repo = os.path.join(self.tmp, "repo")
        os.makedirs(repo)
        make_git_repo(repo)
        git(repo, "worktree", "add", "-q", "-b", "side", self.root)
        self.write("side.txt", "side work\n")
        action = ("if [ -e late.txt ]; then '%(git)s' add late.txt;"
                  " else '%(git)s' update-ref --no-deref HEAD HEAD; fi") % {"git": REAL_GIT}
        srv, task = self.start_with_action(action)
        self.edit("side")
        before = user_state(self.root), user_state(repo)
        result, commands = self.save(srv, "side", edit=False)
        self.assertEqual((user_state(self.root), user_state(repo)), before)
        self.assertEqual(result["ref"], ref_of(task, 1), result)
        self.assertIs(result["unchanged"], True, result)
        self.assertEqual(commands, PLUMBING_ONLY)
        self.assertEqual(checkpoint_refs(repo), [ref_of(task, 1)])
        # The worktree's own index (not the main one) is fingerprinted.
        self.write("late.txt", "late\n")
        main_index = read(repo, ".git/index")
        self.assertChangedDuringSave(srv, task, 2)
        self.assertIn(b"late.txt", git(self.root, "ls-files"))
        self.assertEqual(read(repo, ".git/index"), main_index)
        # So is the worktree's own HEAD: detached at the same commit.
        os.remove(os.path.join(self.root, "late.txt"))
        self.assertEqual(git(self.root, "symbolic-ref", "-q", "HEAD").strip(), b"refs/heads/side")
        self.assertChangedDuringSave(srv, task, 4)
        self.assertEqual(git(self.root, "symbolic-ref", "-q", "HEAD", check=False), b"")
        self.assertEqual(git(repo, "symbolic-ref", "-q", "HEAD").strip(), b"refs/heads/main")

    def make_repo_without_ref_files(self):
        """A reftable repository when git can make one; otherwise a files
        repository with a `reftable` directory, which must be enough to make
        the server ask git instead of reading files."""
        git(self.root, "init", "-q", "-b", "main", "--ref-format=reftable", check=False)
        if not os.path.isdir(os.path.join(self.root, ".git")):
            git(self.root, "init", "-q", "-b", "main")
            os.makedirs(os.path.join(self.root, ".git", "reftable"))
        self.write("README.txt", "hello\n")
        git(self.root, "add", "README.txt")
        git(self.root, "commit", "-q", "-m", "initial")
        git(self.root, "commit", "-q", "--allow-empty", "-m", "second")

    def test_refs_that_are_not_files_are_read_through_git(self):
        self.make_repo_without_ref_files()
        first = rev(self.root, "HEAD~1")
        srv, task = self.start_with_action(
            "'%s' update-ref refs/heads/main %s" % (REAL_GIT, first))
        self.edit("one")
        before = user_state(self.root)
        result, commands = self.save(srv, "one", edit=False)
        self.assertEqual(user_state(self.root), before)
        self.assertEqual(result["ref"], ref_of(task, 1), result)
        self.assertIs(result["unchanged"], True, result)
        for name in ("worktree", "ls-files", "for-each-ref", "stash"):
            self.assertIn(name, commands)
        self.assertNotIn("status", commands)
        self.assertChangedDuringSave(srv, task, 2)
        self.assertEqual(rev(self.root, "refs/heads/main"), first)
        self.assertEqual(rev(self.root, ref_of(task, 3) + "^"), rev(self.root, ref_of(task, 2)))


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class GitEnvironmentTest(GitCase):
    """TC_GIT, TC_GIT_VERIFY and the git environment of the server."""

    @unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
    def test_tc_git_off_starts_no_git_process(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, _task = self.start(env=dict(self.make_spy_git(), TC_GIT="off"))
        result = srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "b\n")
        srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(result["git"]["ok"], False)
        self.assertEqual(result["git"]["reason"], "TC_GIT=off")
        self.assertIsNone(result["git"]["ref"])
        self.assertIsNone(result["git"]["unchanged"])
        self.assertEqual(self.spy_calls(), [])
        self.assertEqual(checkpoint_refs(self.root), [])

    @unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
    def test_git_work_per_save_is_constant_and_never_rehashes(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, _task = self.start(env=self.make_spy_git())
        srv.ok("tc_save", root=self.root, title="one")
        counts, hashed = [], []
        for step, new_files in ((2, 1), (3, 60)):
            for i in range(new_files):
                self.write("s%d/f%03d.txt" % (step, i), "content %d %d\n" % (step, i))
            calls, lines = len(self.spy_calls()), len(self.spy_hashed_lines())
            result = srv.ok("tc_save", root=self.root, title="step %d" % step)
            self.assertEqual(result["git"]["ok"], True, result["git"])
            counts.append(len(self.spy_calls()) - calls)
            hashed.append(self.spy_hashed_lines()[lines:])
        self.assertEqual(counts[0], counts[1], "git processes per save must not grow with files")
        self.assertLessEqual(len(hashed[1]), 60, "only new content is hashed")
        self.assertEqual(set(hashed[0]) & set(hashed[1]), set())

    @unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
    def test_a_ref_taken_during_the_save_does_not_cost_the_next_one_a_rehash(self):
        make_git_repo(self.root)
        for i in range(20):
            self.write("src/f%02d.txt" % i, "file %d\n" % i)
        wanted = os.path.join(self.tmp, "ref-to-take")
        # Someone else creates the very ref while the save is making its commit.
        env = self.make_spy_git(on_commit_tree='%s update-ref "$(cat %s)" HEAD'
                                % (REAL_GIT, wanted))
        srv, task = self.start(env=env)
        srv.ok("tc_save", root=self.root, title="one")
        write(self.tmp, "ref-to-take", ref_of(task, 2))
        self.arm_spy()
        self.write("src/f00.txt", "changed for two\n")
        two = srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(two["git"]["reason"], "ref exists", two["git"])
        self.assertNotIn("ACTION-FAILED", self.spy_action_output())
        self.write("src/f01.txt", "changed for three\n")
        lines = len(self.spy_hashed_lines())
        three = srv.ok("tc_save", root=self.root, title="three")
        self.assertEqual(three["git"]["ok"], True, three["git"])
        # Only three's own new content (f01, and f00 whose commit no ref holds).
        self.assertEqual(len(self.spy_hashed_lines()) - lines, 2)
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 3) + ":src/f01.txt"),
                         b"changed for three\n")

    @unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
    def test_verify_off_reports_null_and_skips_the_fingerprint(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        srv, task = self.start(env=dict(self.make_spy_git(), TC_GIT_VERIFY="off"))
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(result["git"]["ref"], ref_of(task, 1))
        self.assertIsNone(result["git"]["unchanged"])
        words = " ".join(self.spy_calls()).split()
        self.assertNotIn("status", words)
        self.assertNotIn("stash", words)

    def test_server_git_environment_does_not_redirect_writes(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        make_git_repo(other)
        foreign_index = os.path.join(self.tmp, "foreign-index")
        home = os.path.join(self.tmp, "home")
        os.makedirs(home)
        env = {"GIT_DIR": os.path.join(other, ".git"), "GIT_WORK_TREE": other,
               "GIT_INDEX_FILE": foreign_index, "HOME": home, "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_OBJECT_DIRECTORY": os.path.join(other, ".git", "objects")}
        srv, task = self.start(env=env)
        before = user_state(self.root), user_state(other)
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(checkpoint_refs(self.root), [ref_of(task, 1)])
        self.assertEqual(checkpoint_refs(other), [])
        self.assertFalse(os.path.exists(foreign_index))
        self.assertEqual((user_state(self.root), user_state(other)), before)
        self.assertEqual(git(self.root, "cat-file", "blob", ref_of(task, 1) + ":a.txt"), b"a\n")

    def test_user_hooks_do_not_run(self):
        make_git_repo(self.root)
        self.write("a.txt", "a\n")
        marker = os.path.join(self.tmp, "hook-ran")
        hooks = os.path.join(self.root, ".git", "hooks")
        for name in ("reference-transaction", "post-commit", "pre-commit"):
            write(hooks, name, "#!/bin/sh\necho %s >> '%s'\n" % (name, marker), mode=0o755)
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertFalse(os.path.exists(marker), "a user hook ran")
        git(self.root, "update-ref", "refs/heads/probe", "HEAD")
        self.assertTrue(os.path.exists(marker), "the hook is live for plain git")


EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"


def git_own_tree(root, env=None):
    """The tree `git add -A` + `git write-tree` makes of root (the store left
    out), in a scratch index."""
    scratch = dict(QUIET, GIT_INDEX_FILE=os.path.join(root, ".git", "scratch-index"))
    scratch.update(env or {})
    try:
        git(root, "add", "-A", "--", ".", ":(exclude).checkpoints", env=scratch)
        return git(root, "write-tree", env=scratch).decode().strip()
    finally:
        os.unlink(scratch["GIT_INDEX_FILE"])


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class TreeBuildTest(GitCase):
    """The step's tree is computed by the server and written with mktree:
    it must be the very tree git itself makes of the same files."""

    AWKWARD = ("a+", "a-b/x.txt", "a.b", "a/x.txt", "a/y/z.txt", "a0", "b c/d e.txt",
               "\u00fcber/\u00e9t\u00e9.md", "deep/1/2/3/4/5/6/7/8/leaf.txt", "Z/upper.txt",
               "tools/run.sh")

    def write_awkward(self, tag):
        for i, rel in enumerate(self.AWKWARD):
            self.write(rel, "%s %d\n" % (tag, i), mode=0o755 if rel.endswith(".sh") else 0o644)

    def test_tree_is_the_one_git_makes_for_awkward_names(self):
        make_git_repo(self.root)
        self.write_awkward("one")
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(rev(self.root, ref_of(task, 1) + "^{tree}"), git_own_tree(self.root))
        self.write("a/y/z.txt", "edited\n")
        os.remove(os.path.join(self.root, "a0"))
        srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(rev(self.root, ref_of(task, 2) + "^{tree}"), git_own_tree(self.root))
        self.assertTreeMatches(self.root, ref_of(task, 2), expected_tree(self.root))

    def test_many_new_files_hashed_side_by_side(self):
        # Enough files new to git that the server splits hashing over processes.
        make_git_repo(self.root)
        for i in range(300):
            self.write("bulk/%02d/f%03d.txt" % (i % 17, i), "bulk file %d\n" % i * (1 + i % 5))
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="bulk")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(rev(self.root, ref_of(task, 1) + "^{tree}"), git_own_tree(self.root))
        self.assertTreeMatches(self.root, ref_of(task, 1), expected_tree(self.root))

    def test_sha256_repository(self):
        git(self.root, "init", "-q", "--object-format=sha256", "-b", "main")
        self.write_awkward("sha256")
        srv, task = self.start()
        result = srv.ok("tc_save", root=self.root, title="one")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        tree = rev(self.root, ref_of(task, 1) + "^{tree}")
        self.assertEqual(len(tree), 64)
        self.assertEqual(tree, git_own_tree(self.root))

    def test_empty_workspace_commits_the_empty_tree(self):
        make_git_repo(self.root)
        empty = os.path.join(self.root, "empty")
        os.makedirs(empty)
        srv, task = self.start(root=empty)
        result = srv.ok("tc_save", root=empty, title="nothing yet")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        self.assertEqual(rev(self.root, ref_of(task, 1) + "^{tree}"), EMPTY_TREE)

    @unittest.skipUnless(os.name == "posix", "the git spy is a shell script")
    def test_only_changed_directories_are_sent_to_git(self):
        make_git_repo(self.root)
        self.write_awkward("one")
        srv, task = self.start(env=self.make_spy_git())
        srv.ok("tc_save", root=self.root, title="one")
        sent = len(self.spy_tree_input())
        self.write("deep/1/2/3/4/5/6/7/8/leaf.txt", "changed\n")
        srv.ok("tc_save", root=self.root, title="two")
        trees = self.spy_tree_input()[sent:]
        # The leaf's directory and each of its parents up to the root: ten trees.
        self.assertEqual(len(trees), 10, trees)
        self.assertTrue(trees[0].startswith(b"100644 leaf.txt\0"), trees[0])
        self.assertIn(b"40000 deep\0", trees[-1])
        sent = len(self.spy_tree_input())
        calls = len(self.spy_calls())
        srv.ok("tc_save", root=self.root, title="three, nothing changed")
        self.assertEqual(self.spy_tree_input()[sent:], [])
        self.assertNotIn("hash-object -t tree",
                         [subcommand(c) for c in self.spy_calls()[calls:]])
        self.assertEqual(rev(self.root, ref_of(task, 3) + "^{tree}"),
                         rev(self.root, ref_of(task, 2) + "^{tree}"))

    def test_objects_pruned_by_gc_are_written_again(self):
        make_git_repo(self.root)
        self.write_awkward("one")
        srv, task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        # The user throws the checkpoint refs away and prunes everything.
        git(self.root, "update-ref", "-d", ref_of(task, 1))
        git(self.root, "reflog", "expire", "--expire=now", "--all")
        git(self.root, "gc", "-q", "--prune=now")
        self.assertEqual(checkpoint_refs(self.root), [])
        self.write("a/x.txt", "after gc\n")
        result = srv.ok("tc_save", root=self.root, title="two")
        self.assertEqual(result["git"]["ok"], True, result["git"])
        fsck = subprocess.run([REAL_GIT, "fsck", "--no-dangling", "--full"], cwd=self.root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.assertEqual(fsck.returncode, 0, fsck.stderr)
        self.assertTreeMatches(self.root, ref_of(task, 2), expected_tree(self.root))


class ClosingSaveTest(GitCase):
    """A closing save that makes a new step gets that step's ref."""

    def test_closing_save_that_makes_a_step_gets_its_ref(self):
        make_git_repo(self.root)
        srv = self.server(env={"TC_GIT": "on"})
        task = srv.ok("tc_init", root=self.root, name="t")["task_id"]
        self.write("a.txt", "1\n")
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "2\n")
        closed = srv.ok("tc_save", root=self.root, title="final", close=True)
        self.assertFalse(closed["idempotent"])
        ref = "refs/checkpoints/%s/s%04d" % (task, closed["index"])
        self.assertEqual(closed["git"]["ref"], ref, closed["git"])
        self.assertIn(ref.encode(), git(self.root, "for-each-ref", "refs/checkpoints/"))

@unittest.skipIf(REAL_GIT is None, "git is not installed")
class GitIgnoredTest(GitCase):
    """What the repository's own ignore rules ignore stays out of every
    record, ref and report; a tracked file that matches a rule does not."""

    def prepare(self):
        make_git_repo(self.root)
        self.write(".gitignore", "local.yaml\nenv/\n*.log\n")
        self.write("kept.log", "tracked although *.log is ignored\n")
        git(self.root, "add", ".gitignore")
        git(self.root, "add", "-f", "kept.log")
        git(self.root, "commit", "-q", "-m", "rules")
        self.write("local.yaml", "password: hunter2\n")
        self.write("env/lib/site.py", "x = 1\n")
        self.write("run.log", "noise\n")
        self.write("src/app.py", "app\n")

    def step_files(self, srv, index):
        return paths_of(srv.ok("tc_show", root=self.root, index=index)["steps"][0]["files"])

    def test_ignored_files_stay_out_of_steps_refs_and_reports(self):
        self.prepare()
        srv, task = self.start()
        saved = srv.ok("tc_save", root=self.root, title="one")
        files = self.step_files(srv, saved["index"])
        self.assertEqual(files, {".gitignore", "README.txt", "kept.log", "src/app.py"})
        tree = tree_files(self.root, ref_of(task, 1))
        self.assertEqual(sorted(tree), [".gitignore", "README.txt", "kept.log", "src/app.py"])
        self.assertFalse(support.store_holds(self.store, b"password: hunter2\n"),
                         "an ignored secret was stored")
        self.write("local.yaml", "password: changed\n")
        self.write("env/lib/other.py", "y = 2\n")
        self.assertEqual(srv.ok("tc_resume", root=self.root)["drift_paths"], [])
        self.assertFalse(srv.ok("tc_capture", root=self.root)["captured"])

    def test_tc_gitignore_off_records_them(self):
        self.prepare()
        srv, _task = self.start(env={"TC_GITIGNORE": "off"})
        saved = srv.ok("tc_save", root=self.root, title="one")
        self.assertTrue({"local.yaml", "env/lib/site.py", "run.log"}
                        <= self.step_files(srv, saved["index"]))

    def test_a_file_that_became_ignored_is_not_deleted_by_a_step_whose_rules_ignore_it(self):
        make_git_repo(self.root)
        self.write("later.txt", "kept by step one\n")
        srv, _task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        self.write(".gitignore", "later.txt\n")
        second = srv.ok("tc_save", root=self.root, title="rules")["index"]
        self.assertNotIn("later.txt", self.step_files(srv, second))
        os.remove(os.path.join(self.root, ".gitignore"))  # not ignored any more, and edited
        self.write("later.txt", "edited since\n")
        done = srv.ok("tc_restore", root=self.root, index=second, apply=True)
        self.assertEqual(self.read("later.txt"), b"edited since\n")
        self.assertNotIn("later.txt", done["plan"]["to_delete"])
        self.assertIn("later.txt", paths_of(done["plan"]["unrestorable"]))
        srv.ok("tc_restore", root=self.root, drift_id=done["recovered"], apply=True)
        self.assertEqual(self.read("later.txt"), b"edited since\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, ".gitignore")))

    def test_a_folder_holding_only_ignored_files_is_in_the_way_of_a_file(self):
        make_git_repo(self.root)
        self.write(".gitignore", "*.tmp\n")
        self.write("cache", "a file at step one\n")
        srv, _task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        os.remove(os.path.join(self.root, "cache"))
        self.write("cache/scratch.tmp", "ignored, and mine\n")
        srv.ok("tc_save", root=self.root, title="two")
        for paths in (None, ["cache"]):
            arguments = {"paths": paths} if paths else {}
            done = srv.ok("tc_restore", root=self.root, index=1, apply=True, **arguments)
            self.assertNotIn("cache", done["plan"]["to_write"], paths)
            reasons = {i["path"]: i["reason"] for i in done["plan"]["unrestorable"]}
            self.assertIn("in the way", reasons.get("cache", ""), (paths, done["plan"]))
            self.assertEqual(self.read("cache/scratch.tmp"), b"ignored, and mine\n")

    def test_a_step_recorded_with_them_neither_writes_nor_deletes_them_now(self):
        self.prepare()
        old = self.server(env={"TC_GITIGNORE": "off"})
        old.ok("tc_init", root=self.root, name="from before the rules applied")
        first = old.ok("tc_save", root=self.root, title="with local.yaml")["index"]
        old.close()
        srv = self.server()
        self.write("src/app.py", "app, edited\n")
        second = srv.ok("tc_save", root=self.root, title="without")
        drift_id = srv.ok("tc_show", root=self.root, index=second["index"])["steps"][0]["drift_id"]
        drift = [d for d in srv.ok("tc_show", root=self.root, include_drift=True)["drifts"]
                 if d["id"] == drift_id][0]
        self.assertEqual(drift["modified"], ["src/app.py"])
        self.assertFalse({"local.yaml", "run.log"} & set(drift["deleted"]), drift)
        self.assertNotIn("local.yaml", self.step_files(srv, second["index"]))
        self.write("local.yaml", "password: newer\n")
        os.remove(os.path.join(self.root, "run.log"))
        plan = srv.ok("tc_restore", root=self.root, index=first, apply=True)["plan"]
        self.assertNotIn("local.yaml", plan["to_replace"] + plan["to_delete"])
        self.assertNotIn("run.log", plan["to_write"])
        self.assertEqual(self.read("local.yaml"), b"password: newer\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, "run.log")))
        self.assertEqual(self.read("src/app.py"), b"app\n")
        refused = srv.call("tc_restore", root=self.root, index=first, paths=["local.yaml"])
        self.assertTrue(refused.is_error)
        self.assertIn("ignored by git", refused.text)



@unittest.skipIf(REAL_GIT is None, "git is not installed")
class TrackedUnderExcludedNamesTest(GitCase):
    """In a git work tree the always-excluded names give way to git: what
    git tracks in a build/ folder, a shared .vscode/ or a top-level
    backup file is recorded, restored and put in the ref; an untracked
    folder so named is still left out and said so, and the task's own
    exclude still applies to tracked files."""

    TRACKED = {"services/build/make.py": "def make():\n    return 1\n",
               "backup_notes.md": "how the backups run\n",
               ".vscode/settings.json": "{\"editor.tabSize\": 4}\n",
               "vendor/lib.py": "vendored = True\n"}

    def prepare(self):
        make_git_repo(self.root)
        for rel, text in self.TRACKED.items():
            self.write(rel, text)
        git(self.root, "add", *self.TRACKED)
        git(self.root, "commit", "-q", "-m", "tracked under excluded names")
        self.write("services/build/new_step.py", "not yet added\n")  # beside tracked ones
        self.write("web/build/bundle.js", "generated\n")              # nothing tracked there
        self.write("dist/app.tar", "generated\n")

    def test_tracked_files_are_recorded_restored_and_in_the_ref(self):
        self.prepare()
        srv = self.server()
        init = srv.ok("tc_init", root=self.root, name="tracked", exclude=["vendor"])
        left_out = paths_of(init["skipped_paths"])
        self.assertEqual(left_out, {"web/build", "dist", "vendor"})
        first = srv.ok("tc_save", root=self.root, title="one")
        files = paths_of(srv.ok("tc_show", root=self.root, index=1)["steps"][0]["files"])
        self.assertEqual(files, {"README.txt", "services/build/make.py", "backup_notes.md",
                                 ".vscode/settings.json", "services/build/new_step.py"})
        tree = tree_files(self.root, first["git"]["ref"])
        self.assertEqual(tree["services/build/make.py"][0], b"def make():\n    return 1\n")
        self.write("services/build/make.py", "broken edit\n")
        os.remove(os.path.join(self.root, "backup_notes.md"))
        self.write(".vscode/settings.json", "{}\n")
        srv.ok("tc_save", root=self.root, title="two")
        restored = srv.ok("tc_restore", root=self.root, index=1, apply=True)
        for rel in ("services/build/make.py", "backup_notes.md", ".vscode/settings.json"):
            self.assertEqual(self.read(rel), self.TRACKED[rel].encode(), rel)
        self.assertEqual(self.read("web/build/bundle.js"), b"generated\n")
        self.assertNotIn("web/build/bundle.js", paths_of(restored["plan"]["to_delete"]))
        one = srv.ok("tc_restore", root=self.root, index=2, paths=["services/build/make.py"],
                     apply=True)
        self.assertEqual(self.read("services/build/make.py"), b"broken edit\n", one)

    def test_a_step_made_before_tracked_files_were_recorded_keeps_them(self):
        self.prepare()
        srv, task = self.start()
        srv.ok("tc_save", root=self.root, title="one")
        step_path = os.path.join(self.store, "tasks", task, "steps", "s0001.json")
        with open(step_path, encoding="utf-8") as fh:
            record = json.load(fh)
        record["names"] = 2  # made when the names left out what git tracks too
        with open(step_path, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        self.write("services/build/later.py", "made after step one\n")
        git(self.root, "add", "services/build/later.py")
        self.write("src/later.py", "made after step one\n")
        srv.ok("tc_save", root=self.root, title="two")
        plan = srv.ok("tc_restore", root=self.root, index=1, apply=True)["plan"]
        self.assertEqual(self.read("services/build/later.py"), b"made after step one\n")
        self.assertIn("services/build/later.py", paths_of(plan["unrestorable"]))
        self.assertFalse(os.path.exists(os.path.join(self.root, "src", "later.py")))


@unittest.skipIf(REAL_GIT is None, "git is not installed")
class ExternalStorePointerTest(GitCase):
    """An external store leaves its address in the workspace; tc_init says
    that git lists it, until git's rules ignore it."""

    def test_init_says_how_to_keep_the_pointer_out_of_commits(self):
        make_git_repo(self.root)
        srv = self.server()
        store = os.path.join(self.other_dir(), "store")
        note = srv.ok("tc_init", root=self.root, name="outside", store=store)["note"]
        self.assertIn(".task-checkpoint-store.json", note)
        status = git(self.root, "status", "--porcelain", env=QUIET)
        self.assertIn(b".task-checkpoint-store.json", status, "the note is about a real listing")
        self.write(".gitignore", ".task-checkpoint-store.json\n")
        again = srv.ok("tc_init", root=self.root, name="outside again", store=store)["note"]
        self.assertNotIn(".task-checkpoint-store.json", again)


if __name__ == "__main__":
    unittest.main()
