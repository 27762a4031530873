"""task-checkpoint core: checkpoints for long agent tasks, standard library only.

Two layers share one store:

* the task layer: steps the agent declares with ``save`` (title, conclusion,
  next ...), each pointing at a manifest of the workspace's files;
* the drift layer: file changes recorded without the agent doing anything
  (``capture`` and the watcher thread), so a rollback point exists even when
  no step was saved.

Store layout (default ``<workspace>/.checkpoints``)::

    current.json               active task per workspace root
    state.lock                 inter-process lock
    writing                    present while a process writes (a crash leaves it)
    clock                      touched to read the file system's clock
    server.log                 log (never stdout)
    budget.json                what TC_STORE_BUDGET reclaimed, and whether the store fits it
    .gitignore                 "*": git leaves the store alone
    payload/<sha[:2]>/<sha>    content-addressed file copies
    journal/<op>/              in-flight restore/import (rolled back if abandoned)
    kept/<op>.json             content a rollback kept instead of putting it back
    exporting/<name>.json      an export being built (its package removed if it died)
    git/                       cached git object ids of each task's last checkpoint;
                               unchecked.json: tasks whose refs a dead writer may have cut off
    tasks/<id>/state.json, steps/sNNNN.json, drifts/dNNNN.json,
               manifest/mNNNN.json (delta chain, full anchor every 20),
               index.json + index.log (stat cache: table + appended changes),
               receipt.json (files a restore's read-back found changed; until a save)

Guarantees: every store file is written atomically; every mutation happens
under the store lock; content is written before what points at it; a restore
or import is journaled before the workspace is touched, so a crash at any
moment leaves a store that reads correctly and a workspace that is either
before or after the operation, never between.

Caveats: sensitive files are recognised by name only; files over 100 MB keep
a hash but no content; the drift layer detects change by stat, not content.

Code map (each section uses only the ones above it; the tests that cover it):

 1. Constants and Config: the only reader of TC_* variables (test_policy,
    test_protocol).
 2. Errors: CheckpointError and what it says (every test file).
 3. Durability: atomic writes, flushes, JSON records (test_flush, test_faults).
 4. Concurrency: cancellation, the thread pools, StoreLock (test_cancel,
    test_parallel, test_two_servers).
 5. Workspace paths and PathPolicy: safe paths, the guards that keep writes
    inside the workspace, the name rules (test_policy, test_races).
 6. Scan and hash: scan_tree, reading a file as one state (test_statcache,
    test_races).
 7. PayloadStore: payload/<sha[:2]>/<sha> (test_crash, test_faults).
 8. Records: ManifestEntry, IndexRow, record shapes, ManifestLog,
    TaskRecords (test_store, test_statcache).
 9. Journal and Rollback (test_rollback, test_crash).
10. Store, Workspace, Workspaces: location, recovery at the lock, the
    active pointer and task states, resolving a root (test_store,
    test_two_servers).
11. Watcher: watch_decision, DirectoryEvents, the thread (test_drift,
    test_watch_events).
12. Git: GitRefWriter and refs/checkpoints/ (test_git).
13. Handoff format: the handoff text, HANDOFF.md, package checks
    (test_handoff).
14. Recorder: snapshot, index, drift and manifest records (test_statcache,
    test_drift).
15. Operations, one class each: TaskSetup, Saving, Reporting, Restoring
    (with plan_restore), Compaction, Exporting, Importing (test_tools,
    test_restore, test_restore_paths, test_handoff, test_drift); file
    diffs for tc_show and tc_restore before Reporting (test_diff).
16. Checkpoints: the facade the adapter calls (test_tools, test_protocol).
"""

from __future__ import annotations
import collections
import contextlib
import difflib
import errno
import fnmatch
import functools
import gc
import hashlib
import itertools
import json
import operator
import os
import re
import stat as stat_mod
import struct
import sys
import threading
import time

__version__ = "0.1.0"

# What the adapter (tc_mcp.py) uses; the rest is this module's own.
__all__ = ["__version__", "AGENT_LIMIT", "Checkpoints", "CheckpointError", "Config",
           "LABEL_LIMIT", "NotFound", "OS_ERROR_ADVICE", "PATCH_LINE_LIMIT", "TaskClosed",
           "atomic_write", "cancel_event", "cancellable", "cut_patch", "describe_os_error",
           "patch_lines", "traceback_text"]


# ---------------------------------------------------------------------------
# 1. Constants and configuration: Config.from_env() is the only reader of TC_* variables
# ---------------------------------------------------------------------------

STORE_DIRNAME = ".checkpoints"
BUDGET_NAME = "budget.json"  # in the store: what TC_STORE_BUDGET reclaimed
# Drift records of each task that TC_STORE_BUDGET never reclaims: the
# newest, which a person or an agent is most likely to want back.
BUDGET_KEEPS_NEWEST = 20
# Room a budget pass leaves below the budget for what it writes itself after
# measuring the store: its note and its line in server.log.
BUDGET_MARGIN = 4096
KEPT_DIRNAME = "kept"  # in the store: undo content of rollbacks whose workspace was gone
POINTER_NAME = ".task-checkpoint-store.json"
MAX_CONTENT_BYTES = 100 * 1024 * 1024
ANCHOR_EVERY = 20
READ_WHOLE_LIMIT = 1 << 20
CHUNK = 1 << 20
# A file a restore or import writes in more than one write (over this size)
# is read once more by the next scan instead of being trusted by its stat.
WRITTEN_TRUST_LIMIT = CHUNK
# Room beyond the records' own size that content must free before
# tc_compress on a full disk deletes it ahead of marking its records.
ROOM_MARGIN = 64 * 1024
LOCK_TIMEOUT = 120.0
# Files whose mtime or ctime is this close to the moment the index was taken
# are "racily clean": their stat may not reflect a change made in the same
# clock tick, so the next save re-reads them.
RACY_MARGIN_NS = 1_000_000_000
# Windows' ctime is the file's creation time and follows no change, so no
# stat there vouches for content: every save and capture reads every file
# (unless TC_SHA_REUSE trusts mtime and size).
STAT_CACHE_SUPPORTED = os.name == "posix"
# Where files behave as on Windows (no replacing or deleting a file that is
# open or read-only, flushes only through a writable handle).
WINDOWS = os.name == "nt"

# Left out wherever they are, file or folder, and never reported: git's own
# folder (or the .git file of a submodule or linked worktree, which a tree
# may not hold), a store and a store pointer.
OWN_NAMES = frozenset((".git", STORE_DIRNAME, POINTER_NAME))
ALWAYS_EXCLUDED = (
    ".git", STORE_DIRNAME, POINTER_NAME, ".branches", ".history", "backup*",
    "*.bak", ".cursor", ".idea", ".vscode", ".workbuddy", "node_modules",
    "__pycache__", ".venv", "venv", "target", "dist", "build",
)

SENSITIVE_DIRS = (".ssh", ".aws", ".gnupg", ".docker", ".kube", ".env",
                  ".envdir", ".secrets", ".tokens")
SENSITIVE_DIR_SUBSTRINGS = ("secret", "credential", "token")
SENSITIVE_FILES = (
    ".env", ".env.*", "*.env", "*.env.*", ".envrc", "*.envrc",
    "*.pem", "*.key", "*.p12", "*.pfx", "*.p8", "*.jks", "*.keystore", "*.kdbx",
    "*.ppk", "*.ovpn", "*_rsa", "*_dsa", "*_ed25519", "*_ecdsa", "*_key",
    "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519",
    ".netrc", ".git-credentials", ".npmrc", ".pypirc", ".pgpass", ".htpasswd",
    ".my.cnf", "my.cnf", "passwd", "shadow",
    "kubeconfig", "*.kubeconfig", "*.tfstate", "terraform.tfvars", "*.tfvars", "*.jwt",
    "secrets.json", "token", "token.json", "token.txt", "*.token", "*_token", "auth.json",
    "settings.py", "local_settings.py", "settings.xml", "wp-config.php", "web.config",
    "wrangler.toml", ".dev.vars",
    "service-account*", "service_account*", "*.serviceaccount.json", "firebase*.json",
    "appsettings*.json",
)
# credentials* and creds* are among the specification's unambiguous names,
# whatever follows. secret* would also take docs/secrets.md, which the same
# specification leaves alone: it applies only with no extension or a config
# suffix.
SENSITIVE_PREFIXES = ("credentials", "creds")
GUARDED_PREFIXES = ("secret",)
AMBIGUOUS_SUBSTRINGS = ("secret", "password", "passwd", "credential", "api_key",
                        "apikey", "token", "auth_token")
EXTENSIONLESS_SUBSTRINGS = AMBIGUOUS_SUBSTRINGS + ("mytoken", "creds")
CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf",
                   ".config", ".properties", ".xml", ".txt", ".env", ".envrc",
                   ".cnf", ".sh", ".ps1", ".bat", ".cmd", ".sql", ".php")

CONFIG_SUFFIX_SET = frozenset(CONFIG_SUFFIXES)

TRUE_WORDS = {"1", "on", "true", "yes"}
FALSE_WORDS = {"0", "off", "false", "no"}
PLAIN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# What a new task id must also be (an import's): a git ref component, so no
# "..", and no ending in "." or ".lock". Ids already in a store keep working.
NEW_TASK_ID = re.compile(r"^(?!.*\.\.)(?!.*\.lock\Z)(?!.*\.\Z)")
# Steps are numbered from 1; their files take up to nine digits (s000000001).
MAX_STEP = 999_999_999
READ_TRIES = 3  # reads of a file that keeps changing while a snapshot reads it
DRIFT_ID = re.compile(r"^d[0-9]{4,9}\Z")
LABEL_LIMIT = 200  # characters of a drift record's label (tc_capture's, a hook's)


def parse_bool(value, default):
    """on/off, 1/0, true/false, yes/no (any case); anything else is the default."""
    if value is None:
        return default
    word = str(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return default


# The TC_* variables Config reads: switches and seconds, by Config field.
ENV_SWITCHES = (("TC_WATCH", "watch"), ("TC_WATCH_EVENTS", "watch_events"),
                ("TC_GIT", "git"), ("TC_GIT_VERIFY", "git_verify"),
                ("TC_SHA_REUSE", "sha_reuse"), ("TC_FULL_HASH", "full_hash"),
                ("TC_GITIGNORE", "gitignore"))
ENV_SECONDS = (("TC_WATCH_INTERVAL", "watch_interval"), ("TC_DRIFT_MAX_WAIT", "drift_max_wait"))
SECONDS_MINIMUM = 0.05
SECONDS_MAXIMUM = 366 * 86400  # a year; far below what a thread's wait accepts


def parse_seconds(value, default, *, minimum=SECONDS_MINIMUM):
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    if not minimum <= number <= SECONDS_MAXIMUM:  # NaN and infinities fail too
        return default
    return number


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
SIZE_TEXT = re.compile(r"\s*([0-9]{1,15})\s*([KMG]?)B?\s*\Z", re.I)


def parse_size(value):
    """TC_STORE_BUDGET as bytes: a whole number, optionally followed by K, M
    or G (1024, 1024^2, 1024^3); None when it is unset, off, zero or not
    such a size."""
    found = SIZE_TEXT.match(str(value)) if value is not None else None
    if not found:
        return None
    return int(found.group(1)) * SIZE_UNITS[found.group(2).upper()] or None


def threads_setting(value):
    """TC_WORK_THREADS as a number of threads, 1 to 16; None when it is unset
    or not such a number."""
    try:
        number = int(str(value).strip())
    except ValueError:
        return None
    return number if 1 <= number <= 16 else None


class Config(collections.namedtuple(
        "Config", "store watch watch_interval watch_events drift_max_wait git git_verify "
                  "sha_reuse full_hash store_budget gitignore",
        defaults=(None, True, 15.0, True, 60.0, True, True, False, False, None, True))):
    """Settings read once from the environment and passed down: the store
    (a path or None), then the switches and seconds that TC_* variables set,
    and the store's budget in bytes (None: the store never shrinks by itself)."""

    __slots__ = ()

    @classmethod
    def from_env(cls, environ=None):
        env = os.environ if environ is None else environ
        defaults = cls._field_defaults
        values = {"store": env.get("TC_STORE") or None}
        for name, field in ENV_SWITCHES:
            values[field] = parse_bool(env.get(name), defaults[field])
        for name, field in ENV_SECONDS:
            values[field] = parse_seconds(env.get(name), defaults[field])
        values["store_budget"] = parse_size(env.get("TC_STORE_BUDGET"))
        return cls(**values)

    @classmethod
    def problems(cls, environ=None):
        """One line for each TC_* variable set to a value it does not take,
        naming the default used instead (an empty value counts as unset)."""
        env = os.environ if environ is None else environ
        defaults = cls._field_defaults
        out = []
        for name, field in ENV_SWITCHES:
            value = env.get(name)
            if value and value.strip() and parse_bool(value, None) is None:
                out.append("%s=%r is not one of on/off, 1/0, true/false, yes/no; the "
                           "default (%s) is used" % (name, value,
                                                    "on" if defaults[field] else "off"))
        for name, field in ENV_SECONDS:
            value = env.get(name)
            if value and value.strip() and parse_seconds(value, None) is None:
                out.append("%s=%r is not a number of seconds from %g to %d; the default "
                           "(%g) is used" % (name, value, SECONDS_MINIMUM, SECONDS_MAXIMUM,
                                             defaults[field]))
        value = env.get("TC_WORK_THREADS")
        if value and value.strip() and threads_setting(value) is None:
            out.append("TC_WORK_THREADS=%r is not a whole number from 1 to 16; the default "
                       "(half the cores, at most 4) is used" % value)
        value = env.get("TC_STORE_BUDGET")
        if (value and value.strip() and value.strip().lower() not in FALSE_WORDS
                and parse_size(value) is None):
            out.append("TC_STORE_BUDGET=%r is not a size in bytes above 0 (a whole number, "
                       "optionally with K, M or G: 500M); no budget is applied" % value)
        return out


# ---------------------------------------------------------------------------
# 2. Errors: one base class; each message names the object and says what to do
# ---------------------------------------------------------------------------

class CheckpointError(Exception):
    """A failure the caller can act on; the message says what to do."""


class InvalidArgument(CheckpointError):
    pass


class NotFound(CheckpointError):
    pass


class AlreadyExists(CheckpointError):
    pass


class TaskClosed(CheckpointError):
    pass


class UnsafePath(CheckpointError):
    pass


class Conflict(CheckpointError):
    pass


class PathTaken(CheckpointError):
    """A rollback cannot put a file back without removing what was made at
    its path since: a folder with files in it, or a file where one of its
    folders was."""


class StoreCorrupt(CheckpointError):
    pass


class StoreUnwritable(CheckpointError):
    pass


class GitError(CheckpointError):
    pass


class Cancelled(CheckpointError):
    """The client cancelled the call; it stopped before recording anything."""


def describe_os_error(exc):
    """A one-line description of an OSError, without a traceback."""
    name = getattr(exc, "filename", None)
    reason = exc.strerror or exc.__class__.__name__
    return "%s: %r" % (reason, name) if name else reason


# What a user can do about the errors the machine, not the code, causes (a
# traceback would tell them nothing more, so the log gets the message only).
OS_ERROR_ADVICE = {
    errno.ENOSPC: "The disk is full: free space and retry.",
    errno.EDQUOT: "The disk quota is used up: free space and retry.",
    errno.EROFS: "That file system is read-only: make it writable, or use another "
                 "directory, and retry.",
    errno.EACCES: "Permission denied: fix the permissions and retry.",
    errno.EPERM: "The operation is not permitted there (permissions, or an immutable "
                 "file): fix that and retry.",
    errno.EIO: "The disk reported an input/output error: check the disk (the system "
               "log names it) and retry.",
}


def traceback_text():
    """The exception being handled, with its traceback, for the log. A
    traceback module that cannot be loaded (a file descriptor limit, a
    library folder changed under a running server) gives the one-line form:
    a fault being reported must not become a second one."""
    kind, value, _tb = sys.exc_info()
    try:
        import traceback
        return traceback.format_exc()
    except Exception:
        return "%s: %s (no traceback: the traceback module could not be loaded)" % (
            getattr(kind, "__name__", kind), value)


# ---------------------------------------------------------------------------
# 3. Durability: atomic writes, flushes, JSON records
# ---------------------------------------------------------------------------

# fsync refused because the file system does not do it (for directories, say).
FSYNC_UNSUPPORTED = {errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP,
                     getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}
# ... and what SMB shares on macOS answer for a folder (never taken from a file).
FOLDER_FSYNC_UNSUPPORTED = {errno.ENOENT, errno.ENOTTY}


def open_to_flush(path):
    """A descriptor that can fsync path. Windows flushes a file only through
    a handle that may write to it (a read-only one fails with EBADF, which
    counts as "cannot be flushed"); a read-only file is flushed as well as
    Windows then allows."""
    if WINDOWS:
        try:
            return os.open(path, os.O_RDWR | getattr(os, "O_BINARY", 0))
        except PermissionError:
            pass
    return os.open(path, os.O_RDONLY)


def fsync_path(path, *, strict=False):
    """fsync a file or (on POSIX) a directory by name; best effort, unless
    strict: then a failed fsync raises (the bytes may never reach the disk,
    and a kernel reports that only once), except where the file system
    cannot fsync that kind of file at all. A path already gone is skipped.

    On macOS an fsync leaves the drive's own cache unflushed (F_FULLFSYNC
    is not used), so there a power cut, unlike a crash, can still cost the
    last records."""
    try:
        fd = open_to_flush(path)
    except FileNotFoundError:
        return
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if strict and exc.errno not in FSYNC_UNSUPPORTED and not (
                exc.errno in FOLDER_FSYNC_UNSUPPORTED and is_folder(fd)):
            raise named_after(exc, path) from None
    finally:
        os.close(fd)


def is_folder(fd):
    try:
        return stat_mod.S_ISDIR(os.fstat(fd).st_mode)
    except OSError:
        return False


def fsync_dir(path, *, strict=False):
    """fsync a directory (POSIX only); strict as in fsync_path, for the
    directory of a rename the caller reports as durable."""
    if os.name == "posix":
        fsync_path(path, strict=strict)


def random_hex(nbytes):
    return os.urandom(nbytes).hex()


_TEMP_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))


def new_temp(directory, prefix, suffix=""):
    """A new file with an unused random name in directory, readable and
    writable by its owner only: (descriptor, path)."""
    for _ in range(100):
        path = os.path.join(directory, prefix + random_hex(6) + suffix)
        try:
            return os.open(path, _TEMP_FLAGS, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name", directory)


O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
READ_FLAGS = os.O_RDONLY | O_CLOEXEC | getattr(os, "O_BINARY", 0)
# A file swapped for a FIFO or a device after the scan would block an open
# (or never end); swapped for a symlink, it would read a file from elsewhere.
NO_BLOCK = getattr(os, "O_NONBLOCK", 0)
NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


def remove_tree(path):
    """Remove a folder and what it holds, as far as possible; errors are ignored."""
    import shutil  # only for removals, so it is not paid at start-up
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:  # deeper than shutil can go before Python 3.12
        remove_deep_tree(path)


def remove_deep_tree(path):
    """remove_tree without recursion. Each folder is opened without following
    a symlink and listed through that descriptor only when it is still the
    folder its parent's listing showed, so a folder swapped for a link is
    never entered."""
    if os.scandir not in os.supports_fd or os.unlink not in os.supports_dir_fd:
        return
    try:
        top = os.lstat(path)
    except OSError:
        return
    stack = [(path, (top.st_dev, top.st_ino), False)]
    while stack:
        folder, identity, emptied = stack.pop()
        if emptied:
            try:
                os.rmdir(folder)
            except OSError:
                pass
            continue
        try:
            fd = os.open(folder, os.O_RDONLY | NO_FOLLOW | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            seen = os.fstat(fd)
            if (seen.st_dev, seen.st_ino) != identity:
                continue
            stack.append((folder, identity, True))
            with os.scandir(fd) as it:
                for entry in it:
                    try:
                        info = entry.stat(follow_symlinks=False)
                        if stat_mod.S_ISDIR(info.st_mode):
                            stack.append((os.path.join(folder, entry.name),
                                          (info.st_dev, info.st_ino), False))
                        else:
                            os.unlink(entry.name, dir_fd=fd)
                    except OSError:
                        pass
        except OSError:
            pass
        finally:
            os.close(fd)


def make_dirs(path, mkdir=os.mkdir):
    """os.makedirs(path, exist_ok=True) without recursion: a workspace may
    nest folders deeper than Python's recursion limit. mkdir(folder) makes
    one missing folder, parents first."""
    missing = []
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        missing.append(path)
        path = parent
    for folder in reversed(missing):
        try:
            mkdir(folder)
        except FileExistsError:
            if not os.path.isdir(folder):
                raise


def remove_empty_dir(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def replace_record(tmp, path):
    """os.replace of a store record. On Windows a file that another process
    has open cannot be replaced, and the readers of current.json, a state or
    an index take no lock (nor does a virus scanner): the rename is tried
    again for about three seconds."""
    if WINDOWS:
        for delay in (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5):
            try:
                return os.replace(tmp, path)
            except PermissionError:
                time.sleep(delay)
    return os.replace(tmp, path)


class RawFile:
    """An open descriptor read and written with os.read/os.write.

    The per-file hot paths (store, restore, export, import) open thousands
    of files; a buffered file object costs four extra system calls per open
    (close-on-exec, fstat, a terminal check, a seek) and a copy per block."""

    __slots__ = ("fd", "written", "path")

    def __init__(self, fd, path=None):
        self.fd = fd
        self.written = 0
        self.path = path  # named in a failed write (os.write names no file)

    @classmethod
    def open(cls, path, flags, mode=0o666):
        return cls(os.open(path, flags | O_CLOEXEC, mode), path)

    def fileno(self):
        return self.fd

    def read(self, size=CHUNK):
        return os.read(self.fd, size)

    def blocks(self):
        return iter(lambda: os.read(self.fd, CHUNK), b"")

    def read_all(self, size_hint):
        """Everything up to the end of the file, however its size changed
        since size_hint was taken (usually one read and one empty read)."""
        data = os.read(self.fd, size_hint + 1)
        if not data:
            return data
        rest = b"".join(self.blocks())
        return data + rest if rest else data

    def write(self, data):
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            if exc.filename is None and self.path is not None:
                raise named_after(exc, self.path) from None
            raise
        self.written += len(data)

    def tell(self):
        return self.written

    def truncate(self):
        os.ftruncate(self.fd, self.written)

    def flush(self):
        pass

    def close(self):
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_regular(path, *, follow=False):
    """(RawFile, stat) of path opened for reading, only when it is a regular
    file: never blocking on a FIFO or device, and, unless follow is set,
    never through a symlink as its last component. Anything else raises an
    OSError whose text says what was found."""
    try:
        fh = RawFile.open(path, READ_FLAGS | NO_BLOCK | (0 if follow else NO_FOLLOW))
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise OSError(errno.ELOOP, "a symlink (not followed)", path) from None
        raise
    try:
        st = os.fstat(fh.fd)
    except BaseException:
        fh.close()
        raise
    if not stat_mod.S_ISREG(st.st_mode):
        fh.close()
        raise OSError(errno.EINVAL, "not a regular file", path)
    if NO_BLOCK and hasattr(os, "set_blocking"):
        # A regular file: reads as usual (no file system may answer "try again").
        os.set_blocking(fh.fd, True)
    return fh, st


def atomic_write(path, data, *, durable=True, strict=False):
    """Write bytes (or an iterable of byte strings) to path through a unique
    temp file and a rename.

    Readers see the old file or the new one, never a mix; on error the temp
    file is removed and the old file is untouched. strict (a store record):
    a failed flush of the folder after the rename fails the write too; else
    it is best effort, as some shares cannot flush a folder at all.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    try:
        fd, tmp = new_temp(directory, ".tmp-", ".part")
    except OSError as exc:
        raise named_after(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(data, (bytes, bytearray)):
                fh.write(data)
            else:  # an iterable of byte strings
                for part in data:
                    fh.write(part)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        replace_record(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.filename in (tmp, None):
            raise named_after(exc, path) from None  # a write names no file
        raise
    if durable:
        fsync_dir(directory, strict=strict)


def put_back_file(path, before, log):
    """Best effort: path back to the bytes before (None: no file), when it
    changed; what could not be done goes to log."""
    if read_file_or_none(path) == before:
        return
    try:
        if before is None:
            remove_file(path)
        else:
            atomic_write(path, before)
    except OSError as exc:
        log("could not put %r back as it was: %s" % (path, describe_os_error(exc)))


def readlink_or_none(path):
    """Where the symlink path leads; None when path is no symlink."""
    try:
        return os.readlink(path)
    except (OSError, ValueError):
        return None


def put_back_link(path, target, log):
    """Best effort: path back to a symlink to target, when it is not one."""
    try:
        if os.path.islink(path) and os.readlink(path) == target:
            return
        if os.path.lexists(path):
            remove_file(path)
        os.symlink(target, path)
    except OSError as exc:
        log("could not put the link %r back as it was: %s" % (path, describe_os_error(exc)))


def disk_bytes(path):
    """The space path takes on its disk (its blocks; its size where the
    system does not count blocks); 0 when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return 0
    blocks = getattr(st, "st_blocks", None)
    return blocks * 512 if blocks is not None else st.st_size


def named_after(exc, path):
    """The same error about path, for one met on a temporary name of its
    (what the user knows is the file being written, not the staging name)."""
    return OSError(exc.errno, exc.strerror or str(exc), path)


def dump_json(obj, *, sort_keys=True):
    return json.dumps(obj, ensure_ascii=False, sort_keys=sort_keys,
                      separators=(",", ":")).encode("utf-8")


ENCODE_SLICE = 1 << 20


def utf8_slices(text):
    """text encoded a slice at a time, so a large document is never held
    as text and as bytes in full at once."""
    for start in range(0, len(text), ENCODE_SLICE):
        yield text[start:start + ENCODE_SLICE].encode("utf-8")


def write_json(path, obj, *, durable=True, sort_keys=True, strict=False):
    text = json.dumps(obj, ensure_ascii=False, sort_keys=sort_keys, separators=(",", ":"))
    if len(text) <= ENCODE_SLICE:
        atomic_write(path, text.encode("utf-8"), durable=durable, strict=strict)
    else:
        atomic_write(path, utf8_slices(text), durable=durable, strict=strict)


def stage_record(path, obj):
    """obj written to a new temporary name beside path, not yet flushed; the
    temporary name, for the caller to flush and rename over path."""
    directory = os.path.dirname(path)
    try:
        fd, tmp = new_temp(directory, ".tmp-", ".part")
    except OSError as exc:
        raise named_after(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(dump_json(obj))
    except BaseException as exc:
        remove_file(tmp)
        if isinstance(exc, OSError):
            raise named_after(exc, path) from None
        raise
    return tmp


def write_record(path, obj, later=None):
    """A store record: small, so each is made durable on its own (an fsync of
    the file and its directory), which never flushes the user's files.

    With a list `later`, the fsyncs are left to the caller: the record and
    its directory are appended to it, for one fsync_paths before anything
    that points at the record is written.
    """
    if later is None:
        write_json(path, obj, durable=True, strict=True)
    else:
        write_json(path, obj, durable=False)
        later.extend((path, os.path.dirname(path)))


def parse_json(data):
    """json.loads, with nesting too deep for the parser reported as the
    ValueError any other malformed JSON raises (the files read here may come
    from a workspace, a package or a damaged store)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


def read_json(path):
    """Parse a store JSON file; a damaged one raises StoreCorrupt naming it."""
    try:
        fh, st = open_regular(path, follow=True)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # a FIFO or device put in its place
            raise StoreCorrupt("store file %r is not a regular file; remove it" % path) from None
        raise
    with fh:
        data = fh.read_all(st.st_size)
    try:
        return parse_json(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreCorrupt("store file %r does not parse (%s); restore it from a "
                           "backup or remove the task" % (path, exc)) from None


def read_json_or(path, default):
    try:
        return read_json(path)
    except FileNotFoundError:
        return default


def writable_to_remove(path):
    """Windows refuses to delete a read-only file or to rename another file
    over it: clear that flag of a file about to go. Nothing elsewhere (there
    the folder's permissions decide)."""
    if WINDOWS:
        try:
            os.chmod(path, stat_mod.S_IREAD | stat_mod.S_IWRITE)
        except OSError:
            pass


def remove_file(path):
    """Unlink path: True when it was there, False when it was not. A read-only
    file system refuses even to unlink a missing name (EROFS, not ENOENT), so
    a refusal counts as done when nothing is there."""
    writable_to_remove(path)
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        try:
            os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            pass
        raise exc from None


def read_file_or_none(path):
    """The bytes of a regular file (symlinks followed, as git does); None when
    it is missing, cannot be read, or is not a regular file."""
    try:
        fh, st = open_regular(path, follow=True)
        with fh:
            return fh.read_all(st.st_size)
    except OSError:
        return None


_LIBC = []


def c_library():
    """The C library of this process, through ctypes (loaded once)."""
    if not _LIBC:
        import ctypes
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


# File systems whose syncfs writes everything back, journal and cache flush included.
SYNCFS_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs"})
_SYNCFS_TRUST = {}


def mount_table():
    """[(mount point, file system type)] from /proc/self/mounts; [] when unknown."""
    try:
        with open("/proc/self/mounts", "rb") as fh:
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 3:
            point = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            out.append((point, fields[2]))
    return out


def file_system_type(directory, mounts=None):
    """The type of the mount that holds directory, or None."""
    path = os.path.realpath(directory)
    best, kind = "", None
    for point, fs_type in mount_table() if mounts is None else mounts:
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fs_type
    return kind


def file_system_types_under(directory):
    """The types of the file system holding directory and of every mount inside it."""
    mounts = mount_table()
    path = os.path.realpath(directory).rstrip("/") + "/"
    return ({file_system_type(directory, mounts)}
            | {fs_type for point, fs_type in mounts if point.startswith(path)})


def syncfs_trusted(directory):
    """True when directory lies on a local file system named in
    SYNCFS_FILE_SYSTEMS (read from /proc/self/mounts; remembered per
    directory)."""
    hit = _SYNCFS_TRUST.get(directory)
    if hit is None:
        hit = _SYNCFS_TRUST[directory] = file_system_type(directory) in SYNCFS_FILE_SYSTEMS
    return hit


def sync_filesystem(directory):
    """Flush the file system holding directory in one call: True once that
    is done. Only Linux syncfs on a local file system counts (FUSE and
    network file systems do not flush their servers on syncfs); False when
    it is not available or reports an error, and the caller then fsyncs
    file by file, which reports every error."""
    if not sys.platform.startswith("linux") or not syncfs_trusted(directory):
        return False
    try:
        libc = c_library()
        fd = os.open(directory, os.O_RDONLY)
        try:
            return libc.syncfs(fd) == 0
        finally:
            os.close(fd)
    except (OSError, AttributeError, ImportError):
        return False


def unwritten_bytes():
    """Bytes the kernel still has to write back, all file systems together
    (Dirty + Writeback in /proc/meminfo); None where that is not known."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    values = [int(line.split()[1]) * 1024 for line in lines
              if line.startswith((b"Dirty:", b"Writeback:"))]
    return sum(values) if len(values) == 2 else None


# A batch of fsyncs is replaced by one syncfs when the file system has at
# most this much else to write: the flush then costs about one fsync, and
# never waits long for other programs' data.
SYNCFS_OTHER_DIRTY_LIMIT = 4 * 1024 * 1024


# ---------------------------------------------------------------------------
# 4. Concurrency: cancellation, the thread pools, the locks
# ---------------------------------------------------------------------------

CANCELLED_TEXT = "cancelled by the client"
_CALL = threading.local()  # .cancel: the Event of the tool call this thread runs


@contextlib.contextmanager
def cancellable(event):
    """Run the block as a call that stops once event is set.

    The checks sit where stopping changes nothing recorded: between the
    files a snapshot reads, a restore or import writes (both journaled, so
    what they wrote is rolled back) or an export copies, between the
    folders of a walk, and while waiting for the store lock. Work past the
    last of them (the records of a save, the rename of a package) finishes.
    Threads other than the caller's (the watcher) are never cancelled."""
    previous = getattr(_CALL, "cancel", None)
    _CALL.cancel = event
    try:
        yield
    finally:
        _CALL.cancel = previous


def cancel_event():
    """The Event of the call this thread runs, or None outside one."""
    return getattr(_CALL, "cancel", None)


def check_cancelled(event=None):
    event = event or cancel_event()
    if event is not None and event.is_set():
        raise Cancelled(CANCELLED_TEXT)


_GC_PAUSE = {"depth": 0, "was_enabled": False}
_GC_LOCK = threading.Lock()


def gc_paused(fn):
    """Run fn with the cyclic garbage collector paused (reference counting
    still frees everything at once). A scan or an index parse allocates
    thousands of small objects; each burst would otherwise start collections
    that traverse every object the process holds, costing as much as the
    file system calls themselves. Nested and concurrent calls share one pause."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):
        with _GC_LOCK:
            if _GC_PAUSE["depth"] == 0:
                _GC_PAUSE["was_enabled"] = gc.isenabled()
                gc.disable()
            _GC_PAUSE["depth"] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _GC_LOCK:
                _GC_PAUSE["depth"] -= 1
                if _GC_PAUSE["depth"] == 0 and _GC_PAUSE["was_enabled"]:
                    gc.enable()
    return paused


_FLUSH_POOL = []
_WORK_POOL = []
_POOL_LOCK = threading.Lock()


def work_threads(value, cores):
    """Threads that copy and hash files: TC_WORK_THREADS (1 to 16) if set,
    else half the cores, at most 4. On two cores one thread measured faster:
    most of the per-file work is Python under the GIL, and the file system
    needs the other core. Each thread holds up to READ_WHOLE_LIMIT + CHUNK
    bytes at a time."""
    return threads_setting(value) or max(1, min(4, (cores or 1) // 2))


WORK_THREADS = work_threads(os.environ.get("TC_WORK_THREADS"), os.cpu_count())


def _pool(pools, workers, name):
    with _POOL_LOCK:
        if not pools:
            import concurrent.futures  # only when work is spread over threads
            pools.append(concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=name))
        return pools[0]


def in_parallel(fn, items, *, minimum=8):
    """[fn(item) for item in items], run on a few threads when there are at
    least `minimum` items; results in the order of items.

    At most a few calls are queued ahead, so memory does not grow with the
    number of items. On an exception nothing new starts, every call already
    started is waited for (no thread still writes once this returns), and
    the exception of the earliest failing item is raised.
    """
    items = list(items)
    cancel = cancel_event()  # checked between items, in the caller's thread
    if (len(items) < minimum or WORK_THREADS < 2
            or threading.current_thread().name.startswith("tc-work")):
        if cancel is None:
            return [fn(item) for item in items]  # few items, one core's worth, or nested
        results = []
        for item in items:
            check_cancelled(cancel)
            results.append(fn(item))
        return results
    pool = _pool(_WORK_POOL, WORK_THREADS, "tc-work")
    results, window = [], collections.deque()
    try:
        for item in items:
            check_cancelled(cancel)
            window.append(pool.submit(fn, item))
            if len(window) >= 4 * WORK_THREADS:
                # Leaves the window only once done: an interrupt while
                # waiting still finds it there to wait for below.
                results.append(window[0].result())
                window.popleft()
        while window:
            results.append(window[0].result())
            window.popleft()
    except BaseException:
        import concurrent.futures
        for future in window:
            future.cancel()
        concurrent.futures.wait(window)
        raise
    return results


def fsync_paths(paths):
    """fsync many files (and directories) at once. Issued from several
    threads, so the file system commits them together in one journal flush
    rather than one disk wait each; returns when all of them are durable."""
    paths = list(dict.fromkeys(p for p in paths if os.name == "posix" or not os.path.isdir(p)))
    if len(paths) < 3:
        for path in paths:
            fsync_path(path, strict=True)
        return
    strict = functools.partial(fsync_path, strict=True)
    for _ in _pool(_FLUSH_POOL, 8, "tc-fsync").map(strict, paths):
        pass


if os.name == "nt":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd):
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(fd):
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
else:
    import fcntl

    def _try_lock(fd):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(fd):
        fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def workspace_lock(root, *, timeout=LOCK_TIMEOUT):
    """Held while a call decides which store a workspace's new task goes to
    and makes it (tc_init, tc_import): the workspace names one store, and two
    such calls choosing different stores at once would each leave the other's
    task out of reach. An advisory lock on the workspace folder itself, so no
    file is made there; where folders cannot be locked (Windows, some
    network file systems) it holds nothing and each store's own lock remains."""
    fd = None
    if os.name != "nt":
        try:
            fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                         | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            pass
    if fd is None:
        yield
        return
    try:
        deadline = time.monotonic() + timeout
        delay = 0.002
        cancel = cancel_event()
        while True:
            try:
                if _try_lock(fd):
                    break
            except OSError:  # this file system locks no folder
                break
            if time.monotonic() > deadline:
                raise Conflict("another tc_init or tc_import is choosing the store of %r; "
                               "try again" % root)
            check_cancelled(cancel)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def hold_folder_lock(path):
    """A descriptor of folder path holding an advisory lock on it (closing
    it releases the lock), or None where folders cannot be locked. Marks a
    folder being built, for folder_abandoned."""
    if os.name == "nt":
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if _try_lock(fd):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def folder_abandoned(path, *, unknown_after=86400):
    """Whether path is a folder (not a link) whose builder is gone: True when
    no process holds hold_folder_lock on it, False when one does or when
    nothing is there. Where that cannot be told (Windows, file systems that
    lock no folder): True once the folder has not changed for unknown_after
    seconds, else None."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):  # (ValueError: a path no file can have)
        return False
    if not stat_mod.S_ISDIR(st.st_mode):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        fd = None
    if fd is not None:
        try:
            return _try_lock(fd)  # taken: nobody held it (closing releases it again)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True if time.time() - st.st_mtime > unknown_after else None


class StoreLock:
    """An inter-process lock on one store, re-entrant within this process.

    Threads of one process queue on an RLock; processes queue on an OS file
    lock held while the outermost holder is inside. ``on_acquire`` runs each
    time the file lock is newly taken (abandoned journals are rolled back
    there). A store that cannot be written (read-only disk) still allows
    read-only work: the lock then degrades to the in-process RLock.
    """

    def __init__(self, path, *, on_acquire=None, on_release=None, timeout=LOCK_TIMEOUT):
        self.path = path
        self.timeout = timeout
        self.on_acquire = on_acquire
        self.on_release = on_release
        self._rlock = threading.RLock()
        self._depth = 0
        self._fd = None
        self.refusal = None  # the OSError that kept the lock file from being made or opened

    def __enter__(self):
        cancel = cancel_event()
        if cancel is None:
            taken = self._rlock.acquire(timeout=self.timeout)
        else:  # in slices, so a cancelled call stops waiting
            deadline = time.monotonic() + self.timeout
            while not (taken := self._rlock.acquire(timeout=0.05)):
                check_cancelled(cancel)
                if time.monotonic() > deadline:
                    break
        if not taken:
            raise Conflict("the store %r is busy; try again" % os.path.dirname(self.path))
        try:
            if self._depth == 0:
                self._acquire_file()
            self._depth += 1
        except BaseException:
            self._rlock.release()
            raise
        if self._depth == 1 and self.on_acquire and self._fd is not None:
            try:
                self.on_acquire()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def _acquire_file(self):
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._fd = None  # read-only store: in-process lock only
            self.refusal = exc
            return
        self.refusal = None
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        cancel = cancel_event()
        while not _try_lock(fd):
            if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
                os.close(fd)
                check_cancelled(cancel)
                raise Conflict("the store %r is locked by another process; try again"
                               % os.path.dirname(self.path))
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        self._fd = fd

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            try:
                if self.on_release:
                    self.on_release()
            except Exception:
                pass
            try:
                _unlock(self._fd)
            except OSError:
                pass  # the work is done; closing the descriptor releases the lock too
            finally:
                os.close(self._fd)
                self._fd = None
        self._rlock.release()
        return False

    @property
    def writable(self):
        return self._fd is not None


# ---------------------------------------------------------------------------
# 5. Workspace paths and PathPolicy: the one place that refuses unsafe paths
# ---------------------------------------------------------------------------

def normalize_rel(rel):
    """Validate a workspace-relative path; return it in posix form."""
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise UnsafePath("path %r is empty or not a string" % (rel,))
    text = rel.replace("\\", "/") if os.sep == "\\" else rel
    if text.startswith("/") or re.match(r"^[A-Za-z]:", text):
        raise UnsafePath("path %r is absolute; only workspace-relative paths are allowed" % rel)
    parts = text.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath("path %r contains an empty, '.' or '..' segment" % rel)
    return "/".join(parts)


def safe_workspace_path(root, rel, checked=None):
    """The absolute path of rel under root, refusing escapes and symlinked parents.

    checked: a set shared by the calls of one operation, holding the folders
    already found not to be links, so each folder is looked at once rather
    than once per file under it (the file itself always is)."""
    rel = normalize_rel(rel)
    parts = rel.split("/")
    parent = os.path.join(root, *parts[:-1])
    if checked is None or parent not in checked:
        current = root
        for part in parts[:-1]:
            current = os.path.join(current, part)
            if checked is not None and current in checked:
                continue
            if os.path.islink(current):
                raise UnsafePath("path %r goes through the symlink %r" % (rel, current))
            if checked is not None:
                checked.add(current)
    full = os.path.join(parent, parts[-1])
    if os.path.islink(full):
        raise UnsafePath("path %r is a symlink" % rel)
    return full


# Characters that would start a new line, hide text or reorder it in a
# handoff: a file name can hold them, and must not forge a line such as
# "Next step: ..." or pass for another name.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e"
                          "\u2066-\u2069\ufeff]")


def shown_path(path):
    """path for a text a person or a model reads: control characters and
    line separators written as escapes (\\n, \\u001b, \\u2028)."""
    if not _UNPRINTABLE.search(path):
        return path
    return _UNPRINTABLE.sub(lambda m: json.dumps(m.group())[1:-1], path)


def find_upwards(path, predicate):
    """The first of path and its parents for which predicate holds, or None."""
    current = path
    while True:
        if predicate(current):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def looks_like_store(path):
    return (os.path.isfile(os.path.join(path, "state.lock"))
            and os.path.isfile(os.path.join(path, "current.json"))
            and os.path.isdir(os.path.join(path, "tasks")))


# Every name a store holds at its top level (see the README's storage layout).
STORE_TOP_NAMES = frozenset({".gitignore", "state.lock", "clock", "current.json", "writing",
                             "exporting", "journal", KEPT_DIRNAME, "server.log", "payload",
                             "git", "tasks", BUDGET_NAME})


def store_or_empty(path):
    """True for a missing or empty directory, or one that already is a store:
    a complete one, or one a first init left partway (its lock or tasks
    folder, and nothing a store does not hold but the temporary files of a
    write cut short: a project that happens to have a tasks folder is not
    taken over). A .gitignore alone (the one every store holds, or the
    user's) still counts as empty."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (not [n for n in names if n != ".gitignore"] or looks_like_store(path)
            or (("state.lock" in names or "tasks" in names)
                and all(n in STORE_TOP_NAMES or n.startswith(".tmp-") for n in names)))


def enclosing_store(path):
    """The checkpoint store that is path or contains it, or None."""
    return find_upwards(path, lambda directory: os.path.basename(directory) == STORE_DIRNAME
                        or looks_like_store(directory))


def validate_root(root):
    """An absolute, existing directory other than the filesystem root,
    neither a checkpoint store nor inside one."""
    if not isinstance(root, str) or not root.strip():
        raise InvalidArgument("root must be an absolute path to the workspace directory")
    if "\x00" in root:
        raise InvalidArgument("root %r contains a NUL byte" % root)
    if not os.path.isabs(root):
        raise InvalidArgument("root %r is not an absolute path; pass the workspace's "
                              "absolute path" % root)
    real = os.path.realpath(root)
    if not os.path.exists(real):
        raise InvalidArgument("root %r does not exist" % root)
    if not os.path.isdir(real):
        raise InvalidArgument("root %r is not a directory" % root)
    if os.path.dirname(real) == real:
        raise InvalidArgument("root %r is the filesystem root; pass a project directory" % root)
    store = enclosing_store(real)
    if store:
        raise InvalidArgument("root %r lies inside the checkpoint store %r; pass the project "
                              "directory instead" % (root, store))
    return real


def validate_abs_dir(value, name):
    if isinstance(value, str) and "\x00" in value:
        raise InvalidArgument("%s must not contain a NUL character" % name)
    if not isinstance(value, str) or not value:
        raise InvalidArgument("%s must be an absolute path" % name)
    if not os.path.isabs(value):
        raise InvalidArgument("%s %r is not an absolute path" % (name, value))
    return os.path.realpath(value)


def validate_task_id(task_id, name="task_id", *, new=False):
    """task_id when it is a plain name; new: also one git takes as a ref
    component (an id about to be made, not one a store already holds)."""
    if (not isinstance(task_id, str) or not PLAIN_ID.match(task_id)
            or (new and not NEW_TASK_ID.match(task_id))):
        raise InvalidArgument("%s %r is not a valid task id (letters, digits, '.', '_', '-'%s)"
                              % (name, task_id, "; no '..', not ending in '.' or '.lock'"
                                 if new else ""))
    return task_id


def validate_drift_id(drift_id):
    if not isinstance(drift_id, str) or not DRIFT_ID.match(drift_id):
        raise InvalidArgument("drift_id %r is not a drift id of the form dNNNN" % (drift_id,))
    if len(drift_id) > 5 and drift_id[1] == "0":  # records are named d%04d: one name each
        raise InvalidArgument("drift_id %r is not a drift id: they are written d0001 ... "
                              "d9999, d10000 ..., without further leading zeros"
                              % (drift_id[:40],))
    return drift_id


AGENT_LIMIT = 100  # characters of an agent label


def agent_ok(value):
    """Whether value is an agent label a record may hold: one line of text,
    1 to AGENT_LIMIT characters, no surrounding space (see validate_agent)."""
    return (type(value) is str and 0 < len(value) <= AGENT_LIMIT and value.strip() == value
            and not _UNPRINTABLE.search(value))


def validate_agent(agent):
    """The label of who makes a call (e.g. "planner"), as its records keep
    it: stripped, None for none (None or blank). A label is shown on a line
    of its own kind ("Current step: 7 (...) by reviewer"), so a control
    character or line break is refused rather than shown escaped."""
    if agent is None:
        return None
    if not isinstance(agent, str):
        raise InvalidArgument("agent must be a short text naming who makes the call, such as "
                              "'planner' or 'worker-2'")
    label = agent.strip()
    if len(label) > AGENT_LIMIT:
        raise InvalidArgument("agent is too long (%d characters, at most %d): pass a short "
                              "label" % (len(label), AGENT_LIMIT))
    if _UNPRINTABLE.search(label):
        raise InvalidArgument("agent %r contains a control, line-break or text-direction "
                              "character; pass a one-line label" % label[:40])
    return label or None


def validate_expected_head(expected_head):
    """expected_head as a call passes it: None (no check) or the step number
    the caller last read as the head, 0 for no step yet."""
    if expected_head is not None and (type(expected_head) is not int
                                      or not 0 <= expected_head <= MAX_STEP):
        raise InvalidArgument("expected_head must be the head step number tc_resume or "
                              "tc_show gave (0: no step yet), got %s" % repr(expected_head)[:40])
    return expected_head


def store_rel_in(root, store_dir):
    """store_dir relative to root when it lies inside root, else None."""
    rel = os.path.relpath(store_dir, root)
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir or os.path.isabs(rel):
        return None
    return rel.replace(os.sep, "/")


# Kernel interfaces mounted as folders: their "files" are live state, not
# work to checkpoint, and writing a store there does harm or fails.
PSEUDO_FILE_SYSTEMS = frozenset((
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "pstore", "bpf", "configfs", "mqueue", "hugetlbfs", "fusectl",
    "binfmt_misc", "efivarfs", "selinuxfs", "autofs", "rpc_pipefs", "nsfs"))


def refuse_pseudo_file_system(root):
    kind = file_system_type(root)
    if kind in PSEUDO_FILE_SYSTEMS:
        raise InvalidArgument("root %r is on the %s file system, where the kernel shows its "
                              "own state, not files to checkpoint; choose a project "
                              "directory" % (root, kind))


# The guards below compare where the kernel has an open file with where it
# has the workspace root ("guard": kernel_path(root)), both named by the
# kernel, so symlinked ancestors, bind mounts and the case a case-insensitive
# file system keeps cannot make a sound path look foreign. A guard of None
# (Windows) turns the checks off.
def _inside(where, guard):
    return guard is None or where is None or where.startswith(guard.rstrip(os.sep) + os.sep)


def _opened_path(fd, path):
    """Where the kernel has the open file or folder fd (/proc on Linux,
    F_GETPATH on macOS); elsewhere where path resolves now, the best check
    left; None on Windows."""
    try:
        return os.readlink("/proc/self/fd/%d" % fd)
    except OSError:
        pass
    if os.name == "nt":
        return None
    if hasattr(fcntl, "F_GETPATH"):
        try:
            named = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))
            return os.fsdecode(named.split(b"\0", 1)[0])
        except (OSError, ValueError):
            pass
    return os.path.realpath(path)


def kernel_path(root):
    """The guard of a workspace root: its folder as the kernel names it;
    None on Windows, where no check is made."""
    if os.name == "nt":
        return None
    try:
        fd = os.open(root, getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0)
                     | O_CLOEXEC)
    except OSError:
        return os.path.realpath(root)
    try:
        return _opened_path(fd, root)
    finally:
        os.close(fd)


def check_written_within(fd, path, guard):
    """Refuse to write into a file that was opened outside the workspace: a
    folder on its path replaced by a link after the plan checked it. Nothing
    has been written to it yet (workspace files are opened without
    truncating)."""
    if not _inside(_opened_path(fd, path), guard):
        raise UnsafePath("%r now leads outside the workspace (a folder on its path was "
                         "replaced by a link); nothing was written there" % path)


def _at_or_inside(where, guard):
    return where == guard.rstrip(os.sep) or _inside(where, guard)


# Calls that act on a name inside a folder descriptor (mkdirat, unlinkat...).
DIR_FD_CALLS = all(call in getattr(os, "supports_dir_fd", ()) for call in
                   (os.mkdir, os.rmdir, os.unlink, os.rename))


class ChangedMeanwhile(OSError):
    """A workspace file is no longer as the plan of the operation about to
    write or remove it saw it: something else wrote it since."""

    def __init__(self, path):
        super().__init__(errno.EAGAIN, "changed while the operation ran", path)


ANY_STATE = object()  # open_over's and remove_within's expect: no check


def lstat_or_none(path, dir_fd=None):
    try:
        return os.lstat(path, dir_fd=dir_fd) if dir_fd is not None else os.lstat(path)
    except FileNotFoundError:
        return None


def check_expected(st, expect, path):
    """ChangedMeanwhile unless the file at path, whose stat is st (None: no
    file), is as expect says: (size, mtime) of a regular file (seen_as),
    None for "no file", or ANY_STATE for no check."""
    if expect is ANY_STATE:
        return
    if st is None or expect is None:
        if (st is None) != (expect is None):
            raise ChangedMeanwhile(path)
    elif not stat_mod.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != expect:
        raise ChangedMeanwhile(path)


def at_parent_within(path, guard, refusal, call):
    """call(name, dir_fd) on path's last component, through a descriptor of
    its folder taken once that folder is known to be the workspace (guard)
    or inside it: a folder of the path replaced by a link to elsewhere
    cannot redirect the call. Where such descriptors are not available (or
    the folder cannot even be named), call(path, None) after a check by
    path. refusal: what the UnsafePath error says was not done."""
    parent, name = os.path.split(path)
    dfd = None
    if DIR_FD_CALLS:
        try:  # O_PATH: a folder without read permission can still be named
            dfd = os.open(parent, getattr(os, "O_PATH", os.O_RDONLY)
                          | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC)
        except PermissionError:  # no O_PATH and no read permission: by path
            dfd = None
    if dfd is None:
        if not _at_or_inside(os.path.realpath(parent), guard):
            raise UnsafePath("%r now leads outside the workspace; %s" % (path, refusal))
        return call(path, None)
    try:
        if not _at_or_inside(_opened_path(dfd, parent), guard):
            raise UnsafePath("%r now leads outside the workspace (a folder on its path was "
                             "replaced by a link); %s" % (path, refusal))
        try:
            return call(name, dfd)
        except OSError as exc:
            if exc.filename == name:  # named relative to the folder: name the whole path
                raise named_after(exc, path) from None
            raise
    finally:
        os.close(dfd)


def remove_within(path, guard, *, expect=ANY_STATE):
    """remove_file for a workspace file, through its checked folder.
    expect: see check_expected (ChangedMeanwhile, and the file stays, when
    the file no longer matches it)."""
    if guard is None:
        check_expected(lstat_or_none(path), expect, path)
        return remove_file(path)

    def unlink(name, dfd):
        check_expected(lstat_or_none(name, dfd), expect, path)
        if dfd is None:
            writable_to_remove(name)
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False

    try:
        return at_parent_within(path, guard, "it was not removed", unlink)
    except FileNotFoundError:  # its folder is gone
        return False


def rmdir_within(path, guard):
    """os.rmdir of a workspace folder, through its checked parent."""
    if guard is None:
        return os.rmdir(path)
    return at_parent_within(path, guard, "it was not removed",
                            lambda name, dfd: os.rmdir(name, dir_fd=dfd))


def make_dirs_within(path, guard):
    """make_dirs for a workspace folder: each missing folder is made through
    its checked parent, never where a swapped folder points."""
    if guard is None:
        return make_dirs(path)
    return make_dirs(path, lambda folder: at_parent_within(
        folder, guard, "it was not created", lambda name, dfd: os.mkdir(name, dir_fd=dfd)))


def replace_within(tmp, full, guard):
    """os.replace(tmp, full) for two names in one workspace folder, through
    that folder once it is checked."""
    if guard is None:
        writable_to_remove(full)
        return os.replace(tmp, full)
    assert os.path.dirname(tmp) == os.path.dirname(full)

    def replace(name, dfd):
        if dfd is None:
            writable_to_remove(name)
            return os.replace(tmp, name)
        return os.replace(os.path.basename(tmp), name, src_dir_fd=dfd, dst_dir_fd=dfd)

    at_parent_within(full, guard, "nothing was replaced", replace)


def replace_through(tmp, full, name, guard, fill):
    """Put a new file at full by filling the staging name tmp (fill(tmp)) and
    renaming it over full; full's stat after (the rename moves the ctime).
    For a file that cannot be written in place (read-only, hard-linked). An
    error met on tmp names the workspace file, name, instead."""
    try:
        remove_within(tmp, guard)
        fill(tmp)
        replace_within(tmp, full, guard)
    except OSError as exc:
        if exc.filename is not None and exc.filename in (tmp, os.path.basename(tmp)):
            raise named_after(exc, name) from None
        raise
    return os.lstat(full)


def opened_within(fd, st, seen, guard, path):
    """Refuse a workspace file whose open reached outside root: a folder of
    its path replaced by a link after the scan (a race with another process;
    the scan itself never follows one). The file the scan saw (seen: its
    device and inode) passes at once; another one, such as a file an editor
    replaced meanwhile, passes when the kernel places the open file under
    root."""
    if seen is not None and (st.st_dev, st.st_ino) == seen:
        return
    if not _inside(_opened_path(fd, path), guard):
        raise OSError(errno.EXDEV, "reached outside the workspace (a folder on its path "
                      "was replaced by a link)", path)


def ensure_dir(path, made, guard):
    """make_dirs_within once per workspace folder of a batch (made remembers
    what exists)."""
    if path not in made:
        make_dirs_within(path, guard)
        made.add(path)


def prune_empty_dirs(root, directory, guard):
    """Remove directories left empty by deletions, up to (not including) root
    (each through its checked parent)."""
    while directory and directory != root and directory.startswith(root + os.sep):
        try:
            rmdir_within(directory, guard)
        except OSError:
            return
        directory = os.path.dirname(directory)


def missing_dirs(root, rels):
    """Directories a write of rels would create, parents first."""
    out = []
    there = {}  # folder -> whether it exists
    for rel in rels:
        sub, absent = "", False
        for part in rel.split("/")[:-1]:
            sub = sub + "/" + part if sub else part
            known = there.get(sub)
            if known is None:  # below a missing folder nothing exists
                known = there[sub] = not absent and os.path.lexists(os.path.join(root, sub))
                if not known:
                    out.append(sub)
            absent = not known
    return out


def path_length_limit(directory):
    """The longest path (in bytes, with its terminating NUL) the system takes
    under directory, or None where it does not say."""
    try:
        return os.pathconf(directory, "PC_PATH_MAX")
    except (AttributeError, ValueError, OSError):
        return None


def sibling_temp(full, tag):
    digest = hashlib.sha1(os.path.basename(full).encode("utf-8", "surrogatepass")).hexdigest()
    return os.path.join(os.path.dirname(full), ".tc-%s-%s" % (tag[-17:], digest[:12]))


def compile_globs(patterns):
    """One regex matching a whole name against any of the glob patterns."""
    if not patterns:
        return re.compile(r"(?!)")
    return re.compile("|".join(fnmatch.translate(p) for p in patterns))


class GlobSet:
    """Whole names matched against glob patterns, by fnmatch's rules (case as
    given). The usual shapes are answered without a regex: an exact name,
    "*suffix", "prefix*" and "*part*" by set, tuple and substring lookups;
    only the other patterns go through one regex. A workspace has thousands of distinct names and a
    new server classifies each once, so this is most of a first scan."""

    __slots__ = ("exact", "suffixes", "prefixes", "inner", "regex")

    def __init__(self, patterns):
        exact, suffixes, prefixes, inner, other = set(), [], [], [], []
        for pattern in patterns:
            if len(pattern) > 1 and pattern[0] == pattern[-1] == "*":
                body, kind = pattern[1:-1], inner
            elif pattern.startswith("*"):
                body, kind = pattern[1:], suffixes
            elif pattern.endswith("*"):
                body, kind = pattern[:-1], prefixes
            else:
                body, kind = pattern, None
            if any(c in body for c in "*?["):
                other.append(pattern)
            elif kind is None:
                exact.add(pattern)
            else:
                kind.append(body)
        self.exact = frozenset(exact)
        self.suffixes = tuple(suffixes)
        self.prefixes = tuple(prefixes)
        self.inner = tuple(inner)
        self.regex = compile_globs(other) if other else None

    def match(self, name):
        return (name in self.exact or name.endswith(self.suffixes)
                or name.startswith(self.prefixes)
                or (self.inner and any(part in name for part in self.inner))
                or (self.regex is not None and self.regex.match(name) is not None))


SENSITIVE_FILES_GLOBS = GlobSet(SENSITIVE_FILES)


def _split_ext(name):
    base = name.lstrip(".")
    if "." not in base:
        return name, ""
    stem, dot, ext = name.rpartition(".")
    return stem, "." + ext


class PathPolicy:
    """What the scan skips (excluded) and what it never reads (sensitive).

    Exclude patterns and the always-excluded list are globs matched against
    one name segment: a folder's name at any depth, or the first segment of
    a path. So "backup*" leaves out a top-level backup.txt or backup_old/
    and any folder so named, never src/backup_manager.py. Decisions are
    cached per name, so a walk over thousands of files matches each
    distinct name once.

    In a git work tree the always-excluded list gives way to git: a file
    git tracks, or a folder it tracks something in (a tracked build/ of
    scripts, a shared .vscode/), is scanned like any other, and there git's
    own ignore rules decide what is left out. The task's own exclude
    patterns, .git and the store still leave it out. A policy sees git
    through seeing(tracked); the scan asks git_keeps itself.

    store_rel: where a store inside the workspace lies, whatever its name;
    it is left out of every scan.
    """

    def __init__(self, exclude=(), store_rel=None):
        self.exclude = tuple(exclude)
        self.store_rel = store_rel
        self._excluded = GlobSet(ALWAYS_EXCLUDED + self.exclude)
        self._chosen = GlobSet(self.exclude) if self.exclude else None
        self._excluded_cache = {}
        self._sensitive_dir_cache = {}
        self._sensitive_file_cache = {}
        self.tracked = None  # a TrackedSet when seeing git (see seeing)

    def seeing(self, tracked):
        """This policy with git's tracked paths (a TrackedSet, or None
        outside git): a copy sharing the name caches, whose excluded and
        excluded_folder let tracked paths through (see git_keeps)."""
        if tracked is None or not tracked.known:
            return self
        view = object.__new__(PathPolicy)
        view.__dict__.update(self.__dict__)
        view.tracked = tracked
        return view

    def git_keeps(self, rel, name, tracked):
        """True when rel, whose own name (name) an exclude pattern matches,
        is scanned all the same: git tracks it or something in it, and no
        pattern of the task's own exclude matches name."""
        return (name not in OWN_NAMES
                and (tracked.has(rel) or tracked.holds_under(rel))
                and not (self._chosen is not None and self._chosen.match(name)))

    @staticmethod
    def check_patterns(patterns):
        """Validate exclude patterns: plain name globs only."""
        if patterns is None:
            return []
        if not isinstance(patterns, (list, tuple)):
            raise InvalidArgument("exclude must be a list of name patterns, not %r" % (patterns,))
        out = []
        for pattern in patterns:
            if not isinstance(pattern, str) or not pattern.strip():
                raise InvalidArgument("exclude pattern %r is empty" % (pattern,))
            if "\x00" in pattern:
                raise InvalidArgument("exclude pattern %r contains a NUL character, which no "
                                      "name can hold" % pattern)
            if "/" in pattern or "\\" in pattern:
                raise InvalidArgument(
                    "exclude pattern %r contains a path separator; patterns match a "
                    "single file or directory name (e.g. 'config', '*.log')" % pattern)
            if pattern not in out:
                out.append(pattern)
        return out

    def excluded_name(self, name):
        hit = self._excluded_cache.get(name)
        if hit is None:
            hit = self._excluded.match(name)
            self._excluded_cache[name] = hit
        return hit

    def sensitive_dir(self, name):
        hit = self._sensitive_dir_cache.get(name)
        if hit is None:
            low = name.lower()
            hit = low in SENSITIVE_DIRS or any(s in low for s in SENSITIVE_DIR_SUBSTRINGS)
            self._sensitive_dir_cache[name] = hit
        return hit

    def sensitive_file(self, name):
        hit = self._sensitive_file_cache.get(name)
        if hit is None:
            hit = self._classify_file(name.lower())
            self._sensitive_file_cache[name] = hit
        return hit

    @staticmethod
    def _classify_file(low):
        if SENSITIVE_FILES_GLOBS.match(low):
            return True
        if low.startswith(SENSITIVE_PREFIXES):
            return True
        stem, ext = _split_ext(low)
        config = ext in CONFIG_SUFFIX_SET
        if (config or ext == "") and low.startswith(GUARDED_PREFIXES):
            return True
        if config and any(s in stem for s in AMBIGUOUS_SUBSTRINGS):
            return True
        if ext == "" and any(s in low for s in EXTENSIONLESS_SUBSTRINGS):
            return True
        return False

    def excluded(self, rel):
        """True when the scan skips rel (posix, workspace-relative, a file's
        path): the store, a folder on its path with an excluded name, or a
        top-level file with one (unless git keeps it, see the class)."""
        return self._excluded_in(rel, self.tracked)

    def _excluded_in(self, rel, tracked):
        if self.store_rel and (rel == self.store_rel or rel.startswith(self.store_rel + "/")):
            return True
        parts = rel.split("/")
        if len(parts) == 1:
            return self.excluded_name(rel) and not (
                tracked is not None and self.git_keeps(rel, rel, tracked))
        return parts[-1] in OWN_NAMES or self._excluded_on_the_way(parts[:-1], tracked)

    def _excluded_on_the_way(self, folders, tracked):
        """True when a folder of the path folders spells out (its names,
        outermost first) has an excluded name that git (tracked) does not keep."""
        if not any(self.excluded_name(part) for part in folders):
            return False
        if tracked is None:
            return True
        prefix = ""
        for part in folders:
            prefix = prefix + "/" + part if prefix else part
            if self.excluded_name(part) and not self.git_keeps(prefix, part, tracked):
                return True
        return False

    def own_path(self, rel):
        """True when rel is the store's, or lies in or is a .git or store
        entry at any depth: what no scan, restore or import ever touches."""
        if self.store_rel and (rel == self.store_rel or rel.startswith(self.store_rel + "/")):
            return True
        return any(part in OWN_NAMES for part in rel.split("/"))

    def left_out_before(self, rel, names):
        """True for a file that the name rules a record was made with (its
        "names", see NAME_RULES) left out and these do not: under 2, a
        deeper file named like a pattern (src/backup_manager.py); under 3,
        a file git keeps (see the class). Such a record lacks it, whether or
        not it existed."""
        if self.excluded(rel):
            return False
        parts = rel.split("/")
        if names < 2 and len(parts) > 1 and self.excluded_name(parts[-1]):
            return True
        return names < 3 and self.tracked is not None and self._excluded_in(rel, None)

    def excluded_folder(self, rel):
        """True when the scan skips the folder rel: the store, or a folder with
        an excluded name on its path, rel's own name included."""
        if self.store_rel and (rel == self.store_rel or rel.startswith(self.store_rel + "/")):
            return True
        return self._excluded_on_the_way(rel.split("/"), self.tracked)

    def excluded_by(self, name):
        """The pattern that excludes name, for saying why (the first of the
        always-excluded list, then the task's own), or None."""
        for pattern in ALWAYS_EXCLUDED:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
        return None

    def left_out_reason(self, rel, *, folder):
        """Why the scan left out rel (a folder when folder), in a few words."""
        pattern = self.excluded_by(rel.rsplit("/", 1)[-1])
        whose = ("this task's exclude pattern" if pattern in self.exclude
                 and pattern not in ALWAYS_EXCLUDED else "the always-excluded pattern")
        if folder:
            return "a folder whose name matches %s %r: nothing in it is recorded" % (
                whose, pattern)
        return "a top-level file whose name matches %s %r: not recorded" % (whose, pattern)

    def sensitive(self, rel):
        """True when rel is stored by size and mtime only, never by content."""
        parts = rel.split("/")
        if any(self.sensitive_dir(part) for part in parts[:-1]):
            return True
        return self.sensitive_file(parts[-1])


class PolicyCache:
    """One PathPolicy per (root, exclude, store location): its name caches
    then serve every scan of that workspace."""

    LIMIT = 64

    def __init__(self):
        self._lock = threading.Lock()
        self._policies = {}

    def of(self, ws):
        """The policy of a Workspace (anything with policy_key())."""
        key = ws.policy_key()
        with self._lock:
            policy = self._policies.get(key)
            if policy is None:
                if len(self._policies) > self.LIMIT:
                    self._policies.clear()
                policy = self._policies[key] = PathPolicy(key[1], store_rel=key[2])
            return policy

    def clear(self):
        """Forget every policy (their caches are rebuilt by the next scans)."""
        with self._lock:
            self._policies = {}


# - - - Git's ignore rules: pure decisions, no I/O (see GitView for their use) ---

def byte_view(text, fold=False):
    """text (a path or a name as os.scandir gives it) in the form patterns are
    matched against: one character per byte of its file-system encoding,
    ASCII letters lowered when fold."""
    if text.isascii():
        return text.lower() if fold else text
    raw = os.fsencode(text)
    return (raw.lower() if fold else raw).decode("latin-1")


def fold_path(text):
    """text with its ASCII letters lowered, nothing else changed (git's
    case-insensitive comparisons fold ASCII only)."""
    if text.isascii():
        return text.lower()
    return os.fsdecode(os.fsencode(text).lower())


def _ascii_lower(text):
    return text.encode("latin-1").lower().decode("latin-1")


# What wildmatch's [:name:] classes hold, over byte values (ASCII only, and
# git's own isspace: no vertical tab or form feed).
_CLASS_TESTS = {
    "alnum": lambda c: c.isascii() and c.isalnum(),
    "alpha": lambda c: c.isascii() and c.isalpha(),
    "blank": lambda c: c in " \t",
    "cntrl": lambda c: ord(c) < 32 or ord(c) == 127,
    "digit": lambda c: "0" <= c <= "9",
    "graph": lambda c: 33 <= ord(c) <= 126,
    "lower": lambda c: "a" <= c <= "z",
    "print": lambda c: 32 <= ord(c) <= 126,
    "punct": lambda c: 33 <= ord(c) <= 126 and not c.isalnum(),
    "space": lambda c: c in " \t\n\r",
    "upper": lambda c: "A" <= c <= "Z",
    "xdigit": lambda c: c in "0123456789abcdefABCDEF",
}


def _bracket_items(pattern, at):
    """The members of the bracket expression whose "[" is just before at,
    read as git's wildmatch reads them, and the index after its "]"; None
    when it is malformed (no closing "]", a trailing backslash, an unknown
    [:class:]), which makes the whole pattern match nothing."""
    end = len(pattern)
    char = pattern[at] if at < end else ""
    negated = char in ("!", "^")
    if negated:
        at += 1
        char = pattern[at] if at < end else ""
    items, previous = [], ""
    while True:
        if not char:
            return None
        if char == "\\":
            at += 1
            char = pattern[at] if at < end else ""
            if not char:
                return None
            items.append(("eq", char))
        elif char == "-" and previous and at + 1 < end and pattern[at + 1] != "]":
            at += 1
            char = pattern[at]
            if char == "\\":
                at += 1
                char = pattern[at] if at < end else ""
                if not char:
                    return None
            items.append(("range", previous, char))
            char = ""  # a range is not the start of the next one
        elif char == "[" and pattern.startswith(":", at + 1):
            close = pattern.find("]", at + 2)
            if close < 0:
                return None
            if close - at - 3 < 0 or pattern[close - 1] != ":":
                items.append(("eq", "["))  # no ":]": the "[" is an ordinary member
            else:
                name = pattern[at + 2:close - 1]
                if name not in _CLASS_TESTS:
                    return None
                items.append(("class", name))
                at, char = close, ""
        else:
            items.append(("eq", char))
        previous = char
        at += 1
        char = pattern[at] if at < end else ""
        if char == "]":
            return items, negated, at + 1


def _bracket_regex(items, negated, fold):
    """A regex character class of every byte the bracket takes ("/" never),
    or None when it takes none. Under fold the name was lowered first, and
    members are compared as written (so [A] takes nothing) while ranges also
    take a lowered letter whose capital is in range: wildmatch's rules."""
    taken = []
    for code in range(1, 256):
        char = chr(code)
        if char == "/":
            continue
        hit = False
        for item in items:
            kind = item[0]
            if kind == "eq":
                hit = char == item[1]
            elif kind == "range":
                hit = item[1] <= char <= item[2] or (
                    fold and "a" <= char <= "z" and item[1] <= char.upper() <= item[2])
            else:
                hit = _CLASS_TESTS[item[1]](char) or (
                    fold and item[1] == "upper" and "a" <= char <= "z")
            if hit:
                break
        if hit != negated:
            taken.append(code)
    if not taken:
        return None
    runs, start = [], taken[0]
    for previous, code in zip(taken, taken[1:] + [None]):
        if code != previous + 1:
            runs.append("\\x%02x" % start if start == previous
                        else "\\x%02x-\\x%02x" % (start, previous))
            start = code
    return "[" + "".join(runs) + "]"


def wildmatch_regex(pattern, *, fold=False):
    """Regex source that fully matches what git's wildmatch with WM_PATHNAME
    matches of pattern, or None when the pattern can match nothing.

    "*" and "?" stop at "/"; "**" between slashes (or at either end of
    pattern) crosses them, "**/" also matching no folder at all; any other
    "**" is one "*". Note "at the start of pattern": git calls wildmatch
    on what follows a pattern's literal prefix, so in "foo**/bar" the "**"
    counts as leading. Under fold the name is lowered first: literals are
    lowered too, but an escaped capital ("\\A") matches nothing, as in git.
    The regex works on byte-view text (see byte_view), with re.DOTALL.
    """
    out, at, end = [], 0, len(pattern)
    while at < end:
        char = pattern[at]
        if char == "*":
            run = at
            while run < end and pattern[run] == "*":
                run += 1
            if run - at > 1 and (at == 0 or pattern[at - 1] == "/"):
                if run == end:
                    out.append(".*")
                    at = run
                    continue
                if pattern[run] == "/":
                    out.append("(?:.*/)?")
                    at = run + 1
                    continue
                if pattern.startswith("\\/", run):
                    out.append(".*")
                    at = run
                    continue
            out.append("[^/]*")
            at = run
            continue
        if char == "?":
            out.append("[^/]")
            at += 1
            continue
        if char == "[":
            parsed = _bracket_items(pattern, at + 1)
            if parsed is None:
                return None
            items, negated, at = parsed
            klass = _bracket_regex(items, negated, fold)
            if klass is None:
                return None
            out.append(klass)
            continue
        if char == "\\":
            at += 1
            if at == end:
                return None  # a trailing backslash never matches
            char = pattern[at]  # kept as written: an escaped capital never matches under fold
        elif fold and "A" <= char <= "Z":
            char = char.lower()
        out.append(re.escape(char))
        at += 1
    return "".join(out)


def _trim_trailing_spaces(line):
    """line less its unescaped trailing spaces; a line ending in a lone
    backslash keeps them all (git's trim_trailing_spaces)."""
    last_space, at, end = None, 0, len(line)
    while at < end:
        char = line[at]
        if char == " ":
            if last_space is None:
                last_space = at
        elif char == "\\":
            at += 1
            if at == end:
                return line
            last_space = None
        else:
            last_space = None
        at += 1
    return line if last_space is None else line[:last_space]


def _simple_length(text):
    """Length of text's leading part free of glob characters (git's simple_length)."""
    for at, char in enumerate(text):
        if char in "*?[\\":
            return at
    return len(text)


# One usable line of an ignore file. kind: "name" (exact basename), "suffix"
# (basename ending), "name_re" (basename regex), "path" (exact path below
# the file's folder), "path_re" (regex over that path); value: the literal
# or the regex source, in byte view (folded under ignore_case); head: the
# literal start every path it matches has ("" for the basename kinds).
IgnorePattern = collections.namedtuple("IgnorePattern", "negative dir_only kind value head")


def ignore_patterns(data, *, fold=False):
    """The usable patterns of an ignore file's bytes, in file order.

    Lines as git reads them: a UTF-8 BOM skipped, blank lines and lines
    starting with "#" left out, a CR before the LF dropped, the line cut at a
    NUL, unescaped trailing spaces trimmed; then "!" negates, a trailing "/"
    takes directories only, a pattern with no other "/" matches the name at
    any depth and any other is anchored to the file's folder (a leading "/"
    only anchors). Patterns that can match nothing are left out: they never
    decide anything. Never raises.
    """
    text = data.decode("latin-1")
    if text.startswith("\xef\xbb\xbf"):
        text = text[3:]
    out = []
    for line in text.split("\n"):
        if not line or line[0] == "#":
            continue
        if line[-1] == "\r":
            line = line[:-1]
        line = _trim_trailing_spaces(line.split("\0", 1)[0])
        negative = line.startswith("!")
        if negative:
            line = line[1:]
        dir_only = line.endswith("/")
        if dir_only:
            line = line[:-1]
        found = _pattern_kind(line, fold)
        if found is not None:
            out.append(IgnorePattern(negative, dir_only, *found))
    return out


def _pattern_kind(line, fold):
    """(kind, value, head) of one pattern (see IgnorePattern), or None when it can
    match nothing. The literal prefix of an anchored pattern is compared as
    is and only the rest goes through wildmatch, as git's match_pathname
    does."""
    if not line:
        return None
    literal = _simple_length(line)
    if "/" not in line:
        if literal == len(line):
            return "name", _ascii_lower(line) if fold else line, ""
        if line[0] == "*" and _simple_length(line[1:]) == len(line) - 1:
            return "suffix", _ascii_lower(line[1:]) if fold else line[1:], ""
        regex = wildmatch_regex(line, fold=fold)
        return None if regex is None else ("name_re", regex, "")
    if line[0] == "/":
        line, literal = line[1:], literal - 1
    head = _ascii_lower(line[:literal]) if fold else line[:literal]
    if literal == len(line):
        return ("path", head, head) if head else None
    rest = wildmatch_regex(line[literal:], fold=fold)
    return None if rest is None else ("path_re", re.escape(head) + rest, head)


def _compiled(sources):
    """One fullmatch of the alternation of the regex sources (None for none)."""
    if not sources:
        return None
    return re.compile("|".join("(?:%s)" % s for s in sources), re.DOTALL).fullmatch


class _Matcher:
    """The patterns of one file that apply to one kind of entry (files, or
    folders). "Does any name pattern match" is answered by set, suffix and
    one regex lookup and remembered per name (a tree repeats its names, and
    a save walks the same tree again); path patterns are one set and one
    regex lookup, skipped when the path starts with none of their literal
    heads (".vscode/", "docs/": most anchored patterns have one). Only when some pattern matches and the file has a
    negation among them are the patterns tried one by one from the last.
    Its answers never change; the memo is bounded and safe to share
    between threads (a race only computes an answer twice)."""

    __slots__ = ("cut", "names", "suffixes", "name_re", "paths", "path_re", "heads",
                 "any_path", "last_first", "_by_name")

    MEMO_NAMES = 1 << 16

    def __init__(self, patterns, cut):
        names, suffixes, paths, name_res, path_res = set(), [], set(), [], []
        for pattern in patterns:
            kind, value = pattern.kind, pattern.value
            if kind == "name":
                names.add(value)
            elif kind == "suffix":
                suffixes.append(value)
            elif kind == "path":
                paths.add(value)
            elif kind == "name_re":
                name_res.append(value)
            else:
                path_res.append(value)
        self.cut = cut
        self.names = frozenset(names)
        self.suffixes = tuple(suffixes)
        self.name_re = _compiled(name_res)
        self.paths = frozenset(paths)
        self.path_re = _compiled(path_res)
        heads = [p.head for p in patterns if p.kind in ("path", "path_re")]
        # A pattern with no literal head ("**/x", "*/x") can match any path.
        self.heads = tuple(heads) if all(heads) else ("",)
        self.any_path = bool(heads)
        self.last_first = None
        if any(pattern.negative for pattern in patterns):
            self.last_first = tuple((_single_test(p), p.negative) for p in reversed(patterns))
        self._by_name = {}

    def _name_hit(self, name):
        return (name in self.names or name.endswith(self.suffixes)
                or (self.name_re is not None and self.name_re(name) is not None))

    def decide(self, path, name):
        """True (ignored), False (re-included by a "!" pattern) or None (no
        pattern matched) for the entry at path (byte view, relative to the
        top) whose last component is name."""
        hit = self._by_name.get(name)
        if hit is None:
            hit = self._name_hit(name)
            if len(self._by_name) >= self.MEMO_NAMES:
                self._by_name.clear()
            self._by_name[name] = hit
        if not hit:
            if not self.any_path:
                return None
            sub = path[self.cut:]
            if not sub.startswith(self.heads) or (sub not in self.paths and (
                    self.path_re is None or self.path_re(sub) is None)):
                return None
        if self.last_first is None:
            return True
        sub = path[self.cut:]
        for test, negative in self.last_first:
            if test(sub, name):
                return not negative
        return None


def _single_test(pattern):
    """A test (sub, name) -> bool for one pattern (the last-match-wins path)."""
    kind, value = pattern.kind, pattern.value
    if kind == "name":
        return lambda sub, name: name == value
    if kind == "suffix":
        return lambda sub, name: name.endswith(value)
    if kind == "path":
        return lambda sub, name: sub == value
    match = _compiled([value])
    if kind == "name_re":
        return lambda sub, name: match(name) is not None
    return lambda sub, name: match(sub) is not None


class IgnoreRules:
    """One ignore file's patterns, compiled; its answers never change.

    base: the file's folder relative to the top of the work tree ("" for
    the top and for info/exclude), so a file above the workspace root
    matches as it does for git. for_files / for_dirs: the matchers for
    each kind of entry (folder-only patterns in the second), None when no
    pattern applies to that kind.
    """

    __slots__ = ("base", "cut", "for_files", "for_dirs")

    def __init__(self, patterns, base):
        self.base = base
        self.cut = len(byte_view(base)) + 1 if base else 0
        files = [p for p in patterns if not p.dir_only]
        self.for_files = _Matcher(files, self.cut) if files else None
        self.for_dirs = _Matcher(patterns, self.cut) if patterns else None

    @classmethod
    def parse(cls, data, base, *, ignore_case=False):
        """The rules of an ignore file's bytes found in folder base (see the
        class docstring); never raises on any bytes."""
        return cls(ignore_patterns(data, fold=ignore_case), base)

    @property
    def empty(self):
        return self.for_dirs is None


class IgnoreStack:
    """The ignore files in force in one folder of the walk, deepest first,
    info/exclude last; immutable, each folder's stack made from its parent's
    by child().

    offset: the workspace root relative to the top of the work tree ("" or
    "a/b"); paths given to ignored() are workspace-relative. everything:
    the folder lies in an ignored folder (walked only for the tracked
    paths in it): every untracked entry is ignored and no ignore file below
    is read, as git does. parse: how child() turns bytes into IgnoreRules
    (a caching function from GitIgnoreCache, or IgnoreRules.parse).
    """

    __slots__ = ("rules", "offset", "ignore_case", "everything", "parse",
                 "_prefix", "_files", "_dirs")

    def __init__(self, rules=(), *, offset="", ignore_case=False, everything=False,
                 parse=None):
        self.rules = tuple(r for r in rules if not r.empty)
        self.offset = offset
        self.ignore_case = ignore_case
        self.everything = everything
        self.parse = parse
        self._prefix = byte_view(offset + "/", ignore_case) if offset else ""
        self._files = tuple(r.for_files.decide for r in self.rules if r.for_files is not None)
        self._dirs = tuple(r.for_dirs.decide for r in self.rules)

    def _with(self, rules=None, *, offset=None, everything=False):
        return IgnoreStack(self.rules if rules is None else rules,
                           offset=self.offset if offset is None else offset,
                           ignore_case=self.ignore_case, everything=everything,
                           parse=self.parse)

    def child(self, folder_rel, data):
        """The stack for folder_rel (workspace-relative, "" for the root)
        whose .gitignore holds data (None: there is none)."""
        if self.everything or not data:
            return self
        base = "/".join(part for part in (self.offset, folder_rel) if part)
        parse = self.parse or IgnoreRules.parse
        rules = parse(data, base, ignore_case=self.ignore_case)
        if rules.empty:
            return self
        return self._with((rules,) + self.rules)

    def below_ignored(self):
        """The stack for the inside of an ignored folder that holds tracked
        paths: git still walks it, and everything untracked in it is ignored."""
        return self if self.everything else self._with(everything=True)

    def rebased(self, offset):
        """The same rules for paths relative to offset (below the top)."""
        return self._with(offset=offset, everything=self.everything)

    def ignored(self, rel, name, is_dir):
        """True when the untracked entry rel (workspace-relative; name its
        last component) is ignored, given that its folder is not.

        The deepest file with a matching pattern decides, by its last
        matching pattern; folder-only patterns apply when is_dir (a
        symbolic link is not a folder)."""
        if self.everything:
            return True
        chain = self._dirs if is_dir else self._files
        if not chain:
            return False
        if not rel.isascii():
            rel, name = byte_view(rel, self.ignore_case), byte_view(name, self.ignore_case)
        elif self.ignore_case:
            rel, name = rel.lower(), name.lower()
        path = self._prefix + rel
        for decide in chain:
            hit = decide(path, name)
            if hit is not None:
                return hit
        return False

    def change_ignored(self, rel, name, tracked):
        """True when a change reported at rel (in this stack's folder; file or
        folder, unknown which) cannot alter what the scan keeps: the entry
        is ignored either way and untracked, and it is not an ignore file."""
        return (name != ".gitignore" and not tracked.has(rel) and not tracked.holds_under(rel)
                and self.ignored(rel, name, False) and self.ignored(rel, name, True))


class TrackedSet:
    """The paths in git's index below the workspace root (workspace-relative,
    as os.scandir names them) and every folder that holds one. Under
    core.ignoreCase the comparison folds ASCII case, as git's index lookups
    do then. known is False when the index could not be read at all (no
    path is then protected from the ignore rules)."""

    __slots__ = ("paths", "folders", "ignore_case", "known")

    def __init__(self, paths=(), *, ignore_case=False, known=True):
        paths = frozenset(fold_path(p) for p in paths) if ignore_case else frozenset(paths)
        folders = set()
        for path in paths:
            cut = path.rfind("/")
            while cut > 0:
                folder = path[:cut]
                if folder in folders:
                    break
                folders.add(folder)
                cut = path.rfind("/", 0, cut)
        self.paths = paths
        self.folders = frozenset(folders)
        self.ignore_case = ignore_case
        self.known = known

    @classmethod
    def from_index_paths(cls, raw_paths, offset, *, ignore_case=False, known=True):
        """From index paths (bytes, relative to the top) for a workspace
        root at offset below the top ("" or "a/b")."""
        if offset:
            lead = os.fsencode(offset) + b"/"
            if ignore_case:
                lead = lead.lower()
                raw_paths = [p[len(lead):] for p in raw_paths if p[:len(lead)].lower() == lead]
            else:
                raw_paths = [p[len(lead):] for p in raw_paths if p.startswith(lead)]
        return cls(map(os.fsdecode, raw_paths), ignore_case=ignore_case, known=known)

    def has(self, rel):
        """True when rel is in the index (a file, a link or a submodule)."""
        return (fold_path(rel) if self.ignore_case else rel) in self.paths

    def holds_under(self, folder_rel):
        """True when some tracked path lies inside folder_rel."""
        return (fold_path(folder_rel) if self.ignore_case else folder_rel) in self.folders


# ---------------------------------------------------------------------------
# 6. Scan and hash: stat only, content read in one place
# ---------------------------------------------------------------------------

KIND_FILE = "f"        # content stored under its sha
KIND_SENSITIVE = "s"   # size and mtime only
KIND_BIG = "b"         # over the content limit: streamed hash, no content

# One scanned file: its stat fields (ints) and whether its name is sensitive.
StatInfo = collections.namedtuple("StatInfo", "size mtime_ns ctime_ns ino dev mode sensitive")

# files: rel -> StatInfo; skipped: [{"path", "reason"}]; started_ns: when the walk began;
# unreadable: paths the walk could not see into, folders with a trailing "/";
# left_out: (rel, is a folder) of what a name rule left out (see PathPolicy).
# ignored: what git's ignore rules left out (files, folders ending in "/");
# git: the GitView the scan decided them with, or None outside git.
ScanResult = collections.namedtuple("ScanResult", "files skipped started_ns unreadable left_out "
                                                  "ignored git")
# Left out by name but never reported: the store, its pointer and git's own folder.


# A read that failed because the path no longer holds the regular file the
# scan saw (deleted, or replaced by a link or a special file): the file is
# gone, not unknown.
VANISHED_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL}

# Folders are listed through a descriptor opened without following a link,
# and only when it is the folder the listing of its parent named: a folder
# swapped for a link (or a folder on its path swapped) mid-scan is never
# listed, so no file outside the workspace is taken for one of its own.
# Where os.scandir takes no descriptor (Windows), folders are listed by path.
SCAN_BY_DESCRIPTOR = (os.scandir in os.supports_fd and hasattr(os, "O_DIRECTORY")
                      and hasattr(os, "O_NOFOLLOW"))
_ROOT_LIST_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
                    | getattr(os, "O_NONBLOCK", 0))
_FOLDER_LIST_FLAGS = _ROOT_LIST_FLAGS | getattr(os, "O_NOFOLLOW", 0)


class FolderChanged(OSError):
    """The folder at a path is not the one its parent's listing named."""


def open_listed_folder(root, prefix, expected, kernel_root):
    """(descriptor, its stat) of folder prefix under root (root itself for
    ""), opened without following a link. expected: (inode, device of the
    parent) from the parent's listing. Another inode (a mount point, a
    folder renamed into place, or a file system whose listing gives other
    numbers than stat, as FAT does) passes only where the kernel places the
    open folder at prefix under the root as the kernel names it
    (kernel_root(), asked once), not behind a link on the way."""
    path = os.path.join(root, prefix) if prefix else root
    fd = os.open(path, _FOLDER_LIST_FLAGS if prefix else _ROOT_LIST_FLAGS)
    try:
        st = os.fstat(fd)
        if expected is not None and (st.st_ino, st.st_dev) != expected:
            where, base = _opened_path(fd, path), kernel_root()
            if (where is None or base is None
                    or where.rstrip(os.sep) != os.path.join(base, prefix).rstrip(os.sep)):
                raise FolderChanged(errno.ENOTDIR, "changed while it was read", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _list_folder(root, prefix, expected, kernel_root):
    """(listing iterator, its descriptor or None, device, inode) of folder
    prefix under root; by descriptor where the platform allows (see
    open_listed_folder), else by path, with the inode its parent listed."""
    if not SCAN_BY_DESCRIPTOR:
        listing = os.scandir(os.path.join(root, prefix) if prefix else root)
        return listing, None, None, expected[0] if expected else None
    fd, folder = open_listed_folder(root, prefix, expected, kernel_root)
    try:
        return os.scandir(fd), fd, folder.st_dev, folder.st_ino
    except BaseException:
        os.close(fd)
        raise


def _unreadable_folder(prefix, exc):
    """The skipped entry of a folder (prefix ending in "/") not listed whole."""
    return {"path": prefix.rstrip("/"), "reason": "unreadable directory: %s"
            % (exc.strerror or exc.__class__.__name__)}


def _without_folder(prefix, files, stack, skipped, unreadable, left_out):
    """A scan's files, folders still to list, skipped entries, unreadable
    paths and what it left out, less everything under prefix (a folder
    ending in "/")."""
    return ({rel: info for rel, info in files.items() if not rel.startswith(prefix)},
            [item for item in stack if not item[0].startswith(prefix)],
            [item for item in skipped if not (item["path"] + "/").startswith(prefix)],
            [rel for rel in unreadable if not rel.startswith(prefix)],
            [item for item in left_out if not item[0].startswith(prefix)])


def _inode_or_zero(path):
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0


def utf8_name(name):
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


_NO_FOLLOW_READ = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                   | getattr(os, "O_CLOEXEC", 0))


def read_ignore_file(path, *, dir_fd=None):
    """The bytes of a .gitignore in the work tree; None when it is missing,
    unreadable or not a regular file. A symbolic link is not followed: git
    refuses one there too (and warns)."""
    try:
        fd = os.open(path, _NO_FOLLOW_READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


class GitView:
    """Git's ignore decisions in one workspace, as a scan meets them and for
    the paths asked about after it (a restore's targets, index rows the
    scan did not see, the watcher's events): the stack of ignore files in
    force in each folder, read once (the scan fills it as it lists each
    folder, the others are read when asked), and the tracked paths, which
    are never ignored. repo: what load_repo_ignores found for the root."""

    __slots__ = ("root", "repo", "tracked", "watched", "stacks", "ignored_paths", "reader")

    def __init__(self, root, repo, reader=None):
        self.root = root
        self.repo = repo
        self.tracked = repo.tracked
        self.watched = repo.watched  # files outside the workspace that change the decisions
        self.stacks = {}  # folder ("" the root) -> the IgnoreStack in force in it
        self.ignored_paths = []  # what the scan left out: files, folders ending in "/"
        self.reader = reader  # folder -> its .gitignore's bytes, or None (see recorded)

    def recorded(self, entries, payloads):
        """The same repository's decisions under the .gitignore files a
        record holds (entries: its files) instead of those on disk: what git
        ignores once a restore has put that record's rules back."""
        def reader(folder):
            entry = entries.get(folder + "/.gitignore" if folder else ".gitignore")
            if entry is None or entry.kind != KIND_FILE:
                return None
            return read_ignore_file(payloads.path(entry.sha))
        return GitView(self.root, self.repo, reader)

    def listed(self, folder, fd, parent):
        """The stack of folder (no trailing "/"), which the scan has open as
        fd (None: by path), parent's stack extended by its .gitignore."""
        data = None
        if not parent.everything:
            data = (read_ignore_file(".gitignore", dir_fd=fd) if fd is not None
                    else read_ignore_file(self._path(folder, ".gitignore")))
        stack = self.stacks[folder] = parent.child(folder, data)
        return stack

    def stack_of(self, folder):
        """The stack in force in folder, read now if the scan did not list it."""
        stack = self.stacks.get(folder)
        if stack is None:
            if folder:
                up, _, name = folder.rpartition("/")
                parent = self.stack_of(up)
                if parent.ignored(folder, name, True):
                    parent = parent.below_ignored()
            else:
                parent = self.repo.stack
            data = None
            if not parent.everything:
                data = (self.reader(folder) if self.reader is not None
                        else read_ignore_file(self._path(folder, ".gitignore")))
            stack = self.stacks[folder] = parent.child(folder, data)
        return stack

    def _path(self, folder, name):
        return os.path.join(self.root, *(folder.split("/") if folder else ()), name)

    def ignored(self, rel, is_dir=False):
        """True when the scan leaves rel out (rel need not exist): it is not
        tracked, and git ignores it or a folder on its way."""
        if self.tracked.has(rel):
            return False
        up, _, name = rel.rpartition("/")
        folder = ""
        for part in up.split("/") if up else ():
            sub = folder + "/" + part if folder else part
            if self.stack_of(folder).ignored(sub, part, True):
                return True
            folder = sub
        return self.stack_of(up).ignored(rel, name, is_dir)

    def change_ignored(self, rel, name):
        """True when a change the watcher hears of at rel cannot alter what a
        scan keeps (see IgnoreStack.change_ignored)."""
        stack = self.stacks.get(rel.rpartition("/")[0])
        return stack is not None and stack.change_ignored(rel, name, self.tracked)


def _take_listing(listing, prefix, in_sensitive, device, policy, out, ignores=None, git=None):
    """The per-file loop of scan_tree: each entry of one folder's listing
    (prefix ends in "/", or is "" for the root) goes into out = (files,
    skipped, unreadable, folders still to list, left out), with one stat
    per file and name decisions from the policy's per-name caches. A name
    rule applies to a folder at any depth and to a file at the top only
    (see PathPolicy). ignores: the IgnoreStack in force in this folder
    (git: its GitView), or None outside git: an untracked entry it ignores
    is left out (a folder holding tracked paths is still walked, for those),
    and a name rule gives way where git tracks something (PathPolicy.git_keeps)."""
    files, skipped, unreadable, stack, left_out = out
    excluded, sensitive_file = policy.excluded_name, policy.sensitive_file
    sensitive_dir, store_rel = policy.sensitive_dir, policy.store_rel
    is_regular, is_link = stat_mod.S_ISREG, stat_mod.S_ISLNK
    make_info = tuple.__new__  # StatInfo(...) without the Python-level __new__
    top = not prefix
    tracked = git.tracked if git is not None else None
    if ignores is not None:
        ignored_out = git.ignored_paths
    for entry in listing:
        name = entry.name
        if name in OWN_NAMES:
            continue
        if top and excluded(name) and not (tracked is not None
                                           and policy.git_keeps(name, name, tracked)):
            left_out.append((name, entry.is_dir(follow_symlinks=False)))
            continue
        rel = prefix + name
        below = ignores
        if ignores is not None:  # decided before anything is reported, as git does
            is_dir = entry.is_dir(follow_symlinks=False)
            if ignores.ignored(rel, name, is_dir):
                if not is_dir:
                    if not tracked.has(rel):
                        ignored_out.append(rel)
                        continue
                elif tracked.holds_under(rel) or tracked.has(rel):
                    below = ignores.below_ignored()  # walked for its tracked paths only
                else:
                    ignored_out.append(rel + "/")
                    continue
        if not name.isascii() and not utf8_name(name):
            skipped.append({"path": rel.encode("utf-8", "replace").decode("utf-8"),
                            "reason": "name is not valid UTF-8"})
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                if not top and excluded(name) and not (tracked is not None
                                                       and policy.git_keeps(rel, name, tracked)):
                    left_out.append((rel, True))
                elif rel != store_rel:
                    stack.append((rel + "/", in_sensitive or sensitive_dir(name),
                                  (entry.inode(), device), below))
                continue
            st = entry.stat(follow_symlinks=False)
        except OSError as exc:
            if exc.errno in VANISHED_ERRNOS:
                continue  # removed since the folder was listed
            skipped.append({"path": rel, "reason": "unreadable: %s" % (exc.strerror or exc)})
            unreadable.append(rel)
            continue
        mode = st.st_mode
        if not is_regular(mode):
            skipped.append({"path": rel, "reason": "symlink (not followed)"
                            if is_link(mode) else "not a regular file"})
            continue
        files[rel] = make_info(StatInfo, (
            st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
            mode & 0o7777, in_sensitive or sensitive_file(name)))


class PathScope:
    """The files a restore of some paths covers: each path itself and
    everything under it (paths: workspace-relative, in normal form)."""

    def __init__(self, paths):
        self.paths = tuple(sorted(set(paths)))
        self._exact = frozenset(self.paths)
        self._folders = tuple(path + "/" for path in self.paths)

    def __contains__(self, rel):
        return rel in self._exact or rel.startswith(self._folders)

    def walks(self, prefix):
        """Whether a scan lists the folder prefix (ending in "/"): it lies in
        the scope, or on the way to one of its paths."""
        return prefix.startswith(self._folders) or any(
            path.startswith(prefix) for path in self.paths)

    def covering(self, rel):
        """The paths of the scope that rel is or lies under."""
        return [path for path in self.paths if rel == path or rel.startswith(path + "/")]


def scan_tree(root, policy, dirs=None, within=None, git=None):
    """Walk root without following symlinks; stat only, never read content.

    The hot loop of every save, capture and watcher tick: name decisions come
    from the policy's per-name caches, and nothing but one stat per file is
    asked of the file system. A list passed as dirs receives (rel, inode)
    of every directory walked, rel relative to root ("" for root itself).
    within (a PathScope): only the folders on the way to its paths and
    inside them are listed, and only its files (and what stands or is
    skipped on the way to them) are returned, so the walk costs what the
    scope holds. git (a GitView): in a git work tree, what the repository's
    own ignore rules ignore is left out (ScanResult.ignored), untracked
    files only, as git decides.
    """
    started = time.time_ns()
    files, skipped, unreadable, left_out = {}, [], [], []
    cancel = cancel_event()
    known_root = []

    def kernel_root():
        if not known_root:
            known_root.append(kernel_path(root))
        return known_root[0]

    # (prefix, in a sensitive folder, (inode, parent's device), the parent's
    # ignore stack or None)
    stack = [("", False, None, git.repo.stack if git is not None else None)]
    while stack:
        if cancel is not None and cancel.is_set():
            raise Cancelled(CANCELLED_TEXT)
        prefix, in_sensitive, expected, ignores = stack.pop()
        try:
            it, fd, device, inode = _list_folder(root, prefix, expected, kernel_root)
        except OSError as exc:
            if not prefix:  # nothing at all can be known: no snapshot, no "all deleted"
                raise
            if exc.errno in VANISHED_ERRNOS and not isinstance(exc, FolderChanged):
                continue  # removed (or made a link) since its parent was listed
            skipped.append(_unreadable_folder(prefix, exc))
            unreadable.append(prefix)
            continue
        if dirs is not None:
            dirs.append((prefix[:-1], inode if inode is not None else _inode_or_zero(root)))
        pending = len(stack)
        try:
            if ignores is not None:
                ignores = git.listed(prefix[:-1], fd, ignores)
            with it:
                _take_listing(it, prefix, in_sensitive, device, policy,
                              (files, skipped, unreadable, stack, left_out), ignores, git)
            if within is not None:
                stack[pending:] = [item for item in stack[pending:] if within.walks(item[0])]
        except OSError as exc:  # the listing broke off partway
            if not prefix:
                raise
            # The folder is unknown as a whole, like one that cannot be
            # opened: what was already taken from it is dropped again.
            files, stack, skipped, unreadable, left_out = _without_folder(
                prefix, files, stack, skipped, unreadable, left_out)
            skipped.append(_unreadable_folder(prefix, exc))
            unreadable.append(prefix)
        finally:
            if fd is not None:
                os.close(fd)
    if within is not None:  # its files, and a file standing where a folder of it must go
        files = {rel: info for rel, info in files.items()
                 if rel in within or within.walks(rel + "/")}
        skipped = [item for item in skipped
                   if item["path"] in within or within.walks(item["path"] + "/")]
        unreadable = [rel for rel in unreadable
                      if rel.rstrip("/") in within or within.walks(rel.rstrip("/") + "/")]
    return ScanResult(files, skipped, started, unreadable, left_out,
                      git.ignored_paths if git is not None else [], git)


def gone_rows(scan, rows):
    """The paths of index rows the scan did not find: gone, unless the scan
    could not read them, or git now ignores them (no save records those
    as deleted)."""
    unseen = unseen_test(scan.unreadable)
    ignored = scan.git.ignored if scan.git is not None else None
    return [rel for rel in rows if rel not in scan.files and not unseen(rel)
            and not (ignored is not None and ignored(rel))]


def unseen_test(paths):
    """A test of rel: True when it is one of paths, or inside one of the
    folders among them (ending in "/") — what a scan could not read."""
    files = {p for p in paths if not p.endswith("/")}
    folders = tuple(p for p in paths if p.endswith("/"))
    return lambda rel: rel in files or (bool(folders) and rel.startswith(folders))


def diff_maps(old, new):
    """added / modified / deleted between two {path: entry} maps (entry tuples compare)."""
    added, modified, deleted = [], [], []
    for path, entry in new.items():
        before = old.get(path)
        if before is None:
            added.append(path)
        elif before != entry:
            modified.append(path)
    for path in old:
        if path not in new:
            deleted.append(path)
    return sorted(added), sorted(modified), sorted(deleted)


class ChangedWhileRead(OSError):
    """A file's size or times moved while it was read: the bytes read may
    mix two versions, a state the file never had."""

    def __init__(self):
        super().__init__(errno.EAGAIN, "it changed while it was read")


# File times are stamped from a clock that moves in ticks (on Linux the
# kernel's coarse clock, 1 to 10 ms a tick), so writes within one tick may
# leave a file's times as they were; and a write stamps the times when it
# begins, so one begun before a read may still be copying its bytes while
# the read runs. A file whose times fall within RECENT_NS of a read is read
# again once they are RECENT_NS old (see check_unchanged).
RECENT_NS = 10_000_000


def _times_moved(after, st):
    return (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_unchanged(fd, st, count, sha, started_ns):
    """After count bytes hashing to sha were read from the open file fd:
    raise ChangedWhileRead when its size, mtime or ctime moved since st
    (its fstat before the read), unless it only grew and still begins with
    those bytes. That is a file appended to, such as a log: what was read
    is a state it had.

    started_ns: time.time_ns() as the read began. A file changed within
    RECENT_NS of that moment may have been written during the read with
    its times left as they were: its bytes are read once more and must
    hash the same, so what was read is a state it had, not one a write
    still under way passed through. A file over READ_WHOLE_LIMIT is read
    again only once its change is RECENT_NS old (a write of that size takes
    a while to copy); a smaller one, read in one go, at once. Only files
    changed just before they are read pay for the second read. A write
    that stalls halfway for longer than that leaves the file in that state
    meanwhile: it is then what the file holds, and may be recorded so."""
    if not _times_moved(os.fstat(fd), st):
        changed_at = max(st.st_mtime_ns, st.st_ctime_ns)
        if started_ns - RECENT_NS <= changed_at <= started_ns + RECENT_NS:
            settle = changed_at + RECENT_NS - time.time_ns()
            if settle > 0 and count > READ_WHOLE_LIMIT:
                time.sleep(settle / 1e9)
            if _prefix_sha(fd, count) != sha:
                raise ChangedWhileRead()
        else:
            return
    after = os.fstat(fd)
    if not _times_moved(after, st):
        return
    if st.st_size <= count <= after.st_size and _prefix_sha(fd, count) == sha:
        return
    raise ChangedWhileRead()


def _prefix_sha(fd, count):
    digest = hashlib.sha256()
    offset = 0
    while offset < count:
        block = os.pread(fd, min(CHUNK, count - offset), offset)
        if not block:
            return None
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def hash_file(path, *, within=None, seen=None, whole=False):
    """(sha256 hex, bytes read) of a file, streamed; within and seen: see
    opened_within. whole: ChangedWhileRead when the file changed meanwhile."""
    digest = hashlib.sha256()
    total = 0
    fh, st = open_regular(path)
    started = time.time_ns()
    with fh:
        if within is not None:
            opened_within(fh.fd, st, seen, within, path)
        for block in fh.blocks():
            digest.update(block)
            total += len(block)
        if whole:
            check_unchanged(fh.fd, st, total, digest.hexdigest(), started)
    return digest.hexdigest(), total


def file_sha_within(full, guard):
    """sha256 of the regular file full, read only inside the workspace
    (guard); None when there is no such file or it cannot be read."""
    try:
        return hash_file(full, within=guard)[0]
    except (OSError, UnsafePath):
        return None


# ---------------------------------------------------------------------------
# 7. PayloadStore: the only code that knows payload/<sha[:2]>/<sha>
# ---------------------------------------------------------------------------

# Open for writing in place: never through a symlink, never blocking on a FIFO.
# No O_TRUNC: the new bytes are written over the old ones and the file is cut
# to length afterwards. Truncating a file to zero and rewriting it makes ext4
# (auto_da_alloc) start writeback on close, a disk wait per restored file.
WRITE_OVER_FLAGS = (os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                    | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
PAYLOAD_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)


def _open_no_follow(path, flags):
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))


def copy_descriptor(src, dst):
    """Copy what is left of descriptor src into dst (the kernel copies where
    it can: os.copy_file_range); the number of bytes copied."""
    total = 0
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is not None:
        try:
            while True:
                count = copy_range(src, dst, 8 * CHUNK)
                if not count:
                    if total:
                        return total
                    break  # nothing at all: an empty file, or a file system that copies nothing
                total += count
        except OSError as exc:
            if total or exc.errno not in KERNEL_COPY_UNSUPPORTED:
                raise
    for block in iter(lambda: os.read(src, CHUNK), b""):
        view = memoryview(block)
        while view:
            view = view[os.write(dst, view):]
        total += len(block)
    return total


# copy_file_range refusing the pair of files (another file system on old
# kernels, a file system without it): copied through memory instead.
KERNEL_COPY_UNSUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP,
                           errno.EBADF, errno.ETXTBSY, errno.EPERM}


def open_package_file(src):
    """A package file opened for reading, never through a symlink."""
    try:
        return open_regular(src)[0]
    except FileNotFoundError:
        raise InvalidArgument("the package lacks the file %r it lists" % src) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath("the package entry %r is a symlink" % src) from None
        if exc.errno == errno.EINVAL:
            raise UnsafePath("the package entry %r is not a regular file" % src) from None
        raise


def check_package_file(src, sha):
    """Fail unless the package file src hashes to sha (tampered or damaged)."""
    digest = hashlib.sha256()
    with open_package_file(src) as fh:
        for block in fh.blocks():
            digest.update(block)
    if digest.hexdigest() != sha:
        raise InvalidArgument("the package file %r does not match its recorded hash "
                              "(tampered or damaged)" % src)


def open_over(dest, mode, *, within=None, exists=None, expect=ANY_STATE):
    """(file, its stat before writing) of dest opened for writing over in place.

    A missing dest is created with the permission bits mode (less any the
    umask removes); an existing one loses any bit mode lacks before it is
    written. Never wider than mode while the new bytes go in. The caller
    ends with end_over(). within: the guard of the workspace dest must be
    in (see check_written_within); a file this call created outside it is
    removed again. exists: whether dest is expected to exist (the order in
    which to try opening it). expect: what dest must still be when it is
    opened (see check_expected); otherwise ChangedMeanwhile, with nothing
    written and nothing made.
    """
    fh, created = None, False
    if within is not None or expect is not ANY_STATE:  # knowing whether this call made the file
        opens = [(WRITE_OVER_FLAGS & ~os.O_CREAT, False), (WRITE_OVER_FLAGS | os.O_EXCL, True)]
        for flags, making in (opens if exists is not False else opens[::-1]):
            try:
                fh = RawFile.open(dest, flags, mode & 0o777)
                created = making
                break
            except (FileNotFoundError, FileExistsError):  # (another creator meanwhile)
                continue
    if fh is None:
        fh = RawFile.open(dest, WRITE_OVER_FLAGS, mode & 0o777)
    try:
        if within is not None:
            try:
                check_written_within(fh.fd, dest, within)
            except UnsafePath:
                if created:
                    remove_file(dest)
                raise
        before = os.fstat(fh.fileno())
        try:
            check_expected(None if created else before, expect, dest)
        except ChangedMeanwhile:
            if created:
                remove_file(dest)
            raise
        wider = stat_mod.S_IMODE(before.st_mode) & ~mode & 0o7777
        if wider and hasattr(os, "fchmod"):
            # An existing file more open than the content going in (a 0600
            # secret over a 0644 file): narrowed before a byte is written.
            os.fchmod(fh.fileno(), stat_mod.S_IMODE(before.st_mode) & ~wider)
            before = os.fstat(fh.fileno())
        return fh, before
    except BaseException:
        fh.close()
        raise


def end_over(fh, path, before, mode):
    """Cut a file written over in place to what was written and give it
    mode, each only when needed (even a no-op truncate or chmod is a
    journaled inode update on most file systems); its stat afterwards."""
    fh.flush()
    if before.st_size > fh.tell():
        fh.truncate()
    if stat_mod.S_IMODE(before.st_mode) != mode:
        if hasattr(os, "fchmod"):
            os.fchmod(fh.fileno(), mode)
        else:
            os.chmod(path, mode)
    return os.fstat(fh.fileno())


_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_NAMED_SHA = re.compile(rb"[0-9a-f]{64}")


class PayloadStore:
    """Content-addressed copies, written once per content, verified on read."""

    def __init__(self, directory):
        self.directory = directory
        self._prefix = os.path.join(directory, "")
        self.pending = []  # payloads written since the last flush
        self._dirs = set()  # prefix directories known to exist
        self._listings = {}  # prefix -> (mtime_ns, names), see missing()
        self.suspect = False  # a failed write left files behind: check at the next lock
        self.pending_bytes = 0  # bytes of the pending payloads
        self._count_lock = threading.Lock()

    def path(self, sha):
        return os.path.join(self.directory, sha[:2], sha)

    def has(self, sha):
        try:  # os.path.isfile, without the join: this runs once per stored file
            return stat_mod.S_ISREG(os.stat(self._prefix + sha[:2] + os.sep + sha).st_mode)
        except (OSError, ValueError):
            return False

    def missing(self, shas, *, reuse_listings=False):
        """The shas with no stored content: one listing per prefix directory
        holding several of them, one stat for each of the others (a small
        store spreads its content one or two to a directory, where a stat is
        the cheaper check).

        reuse_listings (for reports, never for a decision that writes): a
        prefix directory whose modification time is unchanged, and was more
        than a second old when it was listed, is not listed again. Reading
        those times costs a stat per prefix directory, so it is done only
        where the shas are at least two to a directory on average.
        """
        by_prefix = {}
        count = 0
        for sha in shas:
            by_prefix.setdefault(sha[:2], []).append(sha)
            count += 1
        mtimes = None
        if reuse_listings and len(by_prefix) > 16 and count >= 2 * len(by_prefix):
            mtimes = self._prefix_mtimes()
        out = []
        for prefix, group in by_prefix.items():
            if len(group) < 4 and (mtimes is None or self._listings.get(prefix, (None,))[0]
                                   != mtimes.get(prefix)):
                out.extend(sha for sha in group if not self.has(sha))
                continue
            names = self._listing(prefix, mtimes)
            out.extend(sha for sha in group if sha not in names)
        return out

    def _prefix_mtimes(self):
        try:
            with os.scandir(self.directory) as it:
                return {e.name: e.stat(follow_symlinks=False).st_mtime_ns for e in it}
        except OSError:
            return {}

    def _listing(self, prefix, mtimes):
        mtime = None if mtimes is None else mtimes.get(prefix)
        if mtimes is not None and mtime is None:
            return ()
        cached = self._listings.get(prefix)
        if cached is not None and mtime is not None and cached[0] == mtime:
            return cached[1]
        listed_at = time.time_ns()
        try:
            names = frozenset(os.listdir(os.path.join(self.directory, prefix)))
        except OSError:
            return ()
        if mtime is not None and mtime < listed_at - RACY_MARGIN_NS:
            self._listings[prefix] = (mtime, names)
        return names

    def size(self, sha):
        try:
            return os.path.getsize(self.path(sha))
        except OSError:
            return None

    def put_file(self, src, *, within=None, seen=None, whole=False):
        """Read src once, store its content, return (sha, size, mode, path of
        the payload if this call wrote it, else None). Safe from several threads.
        A workspace file passes within (the root) and seen: see opened_within.
        whole: ChangedWhileRead, and nothing stored, when src changed while
        it was read.

        Small files are read whole; large ones stream into a temp file while
        hashing, so memory does not grow with file size.
        """
        fh, st = open_regular(src)
        started = time.time_ns()
        with fh:
            if within is not None:
                opened_within(fh.fd, st, seen, within, src)
            mode = stat_mod.S_IMODE(st.st_mode)
            if st.st_size <= READ_WHOLE_LIMIT:
                data = fh.read_all(st.st_size)
                sha = hashlib.sha256(data).hexdigest()
                if whole:
                    check_unchanged(fh.fd, st, len(data), sha, started)
                try:
                    written = self._write_bytes(sha, data)  # None when already stored
                except OSError as exc:
                    raise self.unwritable(exc) from None
                return sha, len(data), mode, written
            sha, size, written = self._stream_in(
                fh, check=(lambda count, sha: check_unchanged(fh.fd, st, count, sha, started))
                if whole else None)
            return sha, size, mode, written

    def unwritable(self, exc):
        """A store write failure: the tool fails, rather than the file being
        reported as unreadable and silently left out of the record."""
        return StoreUnwritable("cannot write to the store %r: %s; free space or fix "
                               "permissions and retry" % (os.path.dirname(self.directory),
                                                          exc.strerror or exc))

    def put_bytes(self, data):
        sha = hashlib.sha256(data).hexdigest()
        self._write_bytes(sha, data)
        return sha

    def forget_dirs(self):
        self._dirs.clear()
        self._listings.clear()

    def _prefix_dir(self, sha):
        directory = os.path.join(self.directory, sha[:2])
        if directory not in self._dirs:
            os.makedirs(directory, exist_ok=True)
            self._dirs.add(directory)
        return directory

    def _write_bytes(self, sha, data):
        """Write a payload straight to its final name; its path, or None when
        another thread created it meanwhile (the same content).

        No temporary name and rename: a writer killed midway leaves a short
        payload under the store's "writing" marker, and the next lock holder
        checks every payload written since that marker (verify_since) before
        anything can rely on it. A failed write removes what it created."""
        target = self.path(sha)
        try:
            out = RawFile(self._opener(sha)(target, PAYLOAD_CREATE_FLAGS), target)
        except FileExistsError:
            return None
        try:
            with out:
                out.write(data)
        except BaseException:
            try:
                remove_file(target)
            except OSError:
                self.suspect = True  # the store keeps its "writing" marker for the next check
            raise
        self.pending.append(target)
        self._count(len(data))
        return target

    def verify_since(self, since_ns):
        """Remove payloads modified at or after since_ns whose bytes do not
        hash to their name (a writer died while writing them); their count."""
        removed = 0
        try:
            prefixes = [e.path for e in os.scandir(self.directory) if e.is_dir()]
        except OSError:
            return 0
        for prefix in prefixes:
            try:
                with os.scandir(prefix) as it:
                    recent = [e.path for e in it if e.is_file(follow_symlinks=False)
                              and not e.name.startswith(".tmp-")
                              and e.stat(follow_symlinks=False).st_mtime_ns >= since_ns]
            except OSError:
                continue
            for path in recent:
                try:
                    sha, _size = hash_file(path)
                except OSError:
                    continue
                if sha != os.path.basename(path):
                    removed += remove_file(path)
        return removed

    def _stream_in(self, fh, *, check=None):
        """Copy fh into the store while hashing it: (sha, size, path written
        or None). An error reading fh goes up as it is; one of the store's
        own writes becomes StoreUnwritable, so a failing store is never taken
        for an unreadable workspace file. check(size, sha) runs once all is
        read, before the copy takes its name; what it raises stores nothing."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = new_temp(self.directory, ".tmp-")
        except OSError as exc:
            raise self.unwritable(exc) from None
        digest = hashlib.sha256()
        total = 0
        reading = False
        try:
            with os.fdopen(fd, "wb") as out:
                while True:
                    reading = True
                    block = fh.read(CHUNK)
                    reading = False
                    if not block:
                        break
                    digest.update(block)
                    out.write(block)
                    total += len(block)
            sha = digest.hexdigest()
            if check is not None:
                reading = True
                check(total, sha)
                reading = False
            written = None
            if self.has(sha):
                remove_file(tmp)
            else:
                self._dirs.discard(os.path.dirname(self.path(sha)))
                self._prefix_dir(sha)
                written = self.path(sha)
                os.replace(tmp, written)
                self.pending.append(written)
                self._count(total)
        except BaseException as exc:
            remove_file(tmp)
            if isinstance(exc, OSError) and not reading:
                raise self.unwritable(exc) from None
            raise
        return sha, total, written

    def discard(self, paths):
        """Remove payloads this process has just written and nothing records
        yet (a snapshot that failed or was cancelled part-way), so a full
        disk gets its space back. Only for payloads the caller created under
        the store lock: no other writer can have relied on them."""
        gone = set()
        for path in paths:
            try:
                remove_file(path)
                gone.add(path)
            except OSError:
                self.suspect = True  # checked again at the next lock
        if gone:
            self.pending = [p for p in self.pending if p not in gone]

    def flush(self):
        """Make every payload written since the last flush durable.

        One flush before the manifest that points at them gives the same
        guarantee as an fsync per file, at a fraction of the cost.
        """
        self.flush_with([])

    def flush_with(self, later):
        """flush(), together with the store records listed in later (see write_record).

        One syncfs instead of an fsync per file and directory when there are
        many files, or a batch worth it while little else waits to be written
        (an fsync each costs a disk flush; syncfs costs one for all)."""
        pending, self.pending = self.pending, []
        with self._count_lock:
            written, self.pending_bytes = self.pending_bytes, 0
        paths = pending + sorted({os.path.dirname(p) for p in pending}) + later
        if len(paths) >= 8 and self._one_device(later):
            if len(pending) > 64 and sync_filesystem(self.directory):
                return
            unwritten = unwritten_bytes()
            if (unwritten is not None and unwritten - written <= SYNCFS_OTHER_DIRTY_LIMIT
                    and sync_filesystem(self.directory)):
                return
        fsync_paths(paths)

    def _one_device(self, later):
        """True when the records in later live on the payloads' file system
        (a syncfs of one covers the other)."""
        try:
            device = os.stat(self.directory).st_dev
            return all(os.stat(folder).st_dev == device
                       for folder in {os.path.dirname(p) for p in later})
        except OSError:
            return False

    def _count(self, size):
        with self._count_lock:
            self.pending_bytes += size

    def copy_out(self, sha, dest, mode, *, within=None):
        """Write the payload to dest (a new file), verifying its hash; within:
        the workspace root dest must be under."""
        digest = hashlib.sha256()
        src = self._open_payload(sha)
        # Created with its mode (less the umask), so the usual case needs no chmod.
        with src, RawFile.open(dest, PAYLOAD_CREATE_FLAGS, mode & 0o777) as out:
            if within is not None:
                try:
                    check_written_within(out.fd, dest, within)
                except UnsafePath:
                    remove_file(dest)  # made by this call (O_EXCL), still empty
                    raise
            for block in src.blocks():
                digest.update(block)
                out.write(block)
            if digest.hexdigest() == sha:
                end_over(out, dest, os.fstat(out.fd), mode)
        if digest.hexdigest() != sha:
            remove_file(dest)
            raise StoreCorrupt("stored content %s is damaged (hash mismatch)" % sha[:12])

    def write_over(self, sha, dest, mode, *, within=None, exists=None, expect=ANY_STATE):
        """Write the payload into dest in place (created or truncated) and verify it.

        No staging copy: callers journal dest first, so a failure or a crash
        midway is undone by the journal's rollback. expect: see open_over.
        """
        src = self._open_payload(sha)
        digest = hashlib.sha256()
        with src:
            out, before = open_over(dest, mode, within=within, exists=exists, expect=expect)
            with out:
                for block in src.blocks():
                    digest.update(block)
                    out.write(block)
                after = end_over(out, dest, before, mode)
        if digest.hexdigest() != sha:
            raise StoreCorrupt("stored content %s is damaged (hash mismatch)" % sha[:12])
        return after

    def store_verified(self, src, sha):
        """Store the package file src as the payload sha (unless stored
        already), checking its bytes hash to sha as they are copied; a
        mismatch removes the copy and fails. The path written, or None."""
        target = self.path(sha)
        with open_package_file(src) as fh:
            try:
                out = RawFile(self._opener(sha)(target, PAYLOAD_CREATE_FLAGS), target)
            except FileExistsError:
                return None
            digest = hashlib.sha256()
            try:
                with out:
                    for block in fh.blocks():
                        digest.update(block)
                        out.write(block)
                if digest.hexdigest() != sha:
                    raise InvalidArgument("the package file %r does not match its recorded "
                                          "hash (tampered or damaged)" % src)
            except BaseException:
                remove_file(target)
                raise
        self.pending.append(target)
        self._count(out.written)
        return target

    def place_stored(self, sha, dest, mode, *, within=None, expect=ANY_STATE):
        """Write the payload sha into dest in place, as write_over does, for a
        payload this operation has just written and checked: copied by the
        kernel, without hashing it again. dest's stat once written."""
        src = self._open_payload(sha)
        with src:
            size = os.fstat(src.fd).st_size
            out, before = open_over(dest, mode, within=within, expect=expect)
            with out:
                try:
                    out.written = copy_descriptor(src.fd, out.fd)
                except OSError as exc:  # a full disk is the writing side's
                    if exc.filename is None and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise named_after(exc, dest) from None
                    raise
                if out.written != size:
                    raise StoreCorrupt("stored content %s could not be copied whole (%d of %d "
                                       "bytes)" % (sha[:12], out.written, size))
                return end_over(out, dest, before, mode)

    def import_file(self, src, dest, sha, mode, *, within=None, expect=ANY_STATE):
        """Copy src into dest (written over in place) and, when missing, into
        the store, in one read; dest's stat once written.

        Journaled by the caller: its rollback undoes dest and removes the
        payloads it listed as new, so the store copy is written straight to
        its final name (no temporary name and rename per file); a copy whose
        bytes do not hash to sha is removed before this returns.
        """
        store_path = None
        digest = hashlib.sha256()
        try:
            with open_package_file(src) as fh:
                out, before = open_over(dest, mode, within=within, expect=expect)
                with out:
                    try:
                        copy = RawFile(self._opener(sha)(self.path(sha),
                                                         PAYLOAD_CREATE_FLAGS), self.path(sha))
                        store_path = self.path(sha)
                    except FileExistsError:  # already stored (or by another thread now)
                        copy = None
                    with copy if copy else contextlib.nullcontext():
                        for block in fh.blocks():
                            digest.update(block)
                            out.write(block)
                            if copy:
                                copy.write(block)
                    after = end_over(out, dest, before, mode)
            if digest.hexdigest() != sha:
                raise InvalidArgument("the package file %r does not match its recorded hash "
                                      "(tampered or damaged)" % src)
            if store_path:
                self.pending.append(store_path)
                self._count(after.st_size)
                store_path = None
        finally:
            if store_path:
                remove_file(store_path)
        return after

    def _opener(self, sha):
        """An opener for open() that creates the prefix directory on demand."""
        def opener(path, flags):
            try:
                return os.open(path, flags | O_CLOEXEC, 0o600)
            except FileNotFoundError:
                self._dirs.discard(os.path.dirname(path))
                self._prefix_dir(sha)
                return os.open(path, flags | O_CLOEXEC, 0o600)
        return opener

    def _open_payload(self, sha):
        try:
            return open_regular(self.path(sha))[0]
        except FileNotFoundError:
            raise StoreCorrupt("stored content %s is missing from the payload store"
                               % sha[:12]) from None

    def stored_before(self, cutoff_ns):
        """(sha, size) of every stored content whose file was last modified
        before cutoff_ns; names that are not a sha256 in their own prefix
        folder (temporary files, strays) are left out."""
        out = []
        try:
            with os.scandir(self.directory) as it:
                prefixes = [e for e in it if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for prefix in prefixes:
            try:
                with os.scandir(prefix.path) as it:
                    for entry in it:
                        if (entry.name[:2] != prefix.name or not _SHA256.match(entry.name)
                                or not entry.is_file(follow_symlinks=False)):
                            continue
                        info = entry.stat(follow_symlinks=False)
                        if info.st_mtime_ns < cutoff_ns:
                            out.append((entry.name, info.st_size))
            except OSError:
                continue
        return out

    def delete(self, sha):
        """Remove one payload; its size, or 0 when there was none. A name
        that is not a sha256 (a damaged record) never reaches the file system."""
        if not isinstance(sha, str) or not _SHA256.match(sha):
            return 0
        path = self.path(sha)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
            return size
        except OSError:
            return 0


# ---------------------------------------------------------------------------
# 8. Records: one named shape per record, and the files that hold them
# ---------------------------------------------------------------------------

class ManifestEntry(collections.namedtuple("ManifestEntry", "kind sha size mode mtime_ns")):
    """What a record keeps of one file: its kind (KIND_FILE, KIND_SENSITIVE,
    KIND_BIG), the sha256 of its content (None for a sensitive file), its
    size and permission bits, and mtime_ns, kept only for sensitive files
    (the one thing that tells they changed) and 0 otherwise, so touching a
    file does not make a new manifest. Stored as a JSON array in this order;
    entries compare as tuples."""

    __slots__ = ()


def manifest_entry(kind, sha, size, mode, mtime_ns=0):
    return tuple.__new__(ManifestEntry, (kind, sha, size, mode,
                                         mtime_ns if kind == KIND_SENSITIVE else 0))


def as_entry(values):
    """A ManifestEntry of a stored [kind, sha, size, mode, mtime_ns] (checked
    by entries_ok before)."""
    return tuple.__new__(ManifestEntry, values)


class IndexRow(collections.namedtuple("IndexRow", "size mtime_ns ctime_ns ino dev mode kind "
                                                  "sha")):
    """One file of a task's index, the stat cache: the stat the file had
    when its content was last known (size to dev are a StatInfo's first
    five fields), its permission bits, and that content's kind and sha.
    Stored as a JSON array in this order. A ctime_ns of -1 is one no file
    has: the stat cache then never vouches for the row (see unvouched)."""

    __slots__ = ()

    def unvouched(self):
        """This row with a ctime no file has: the next scan reads the file."""
        return self._replace(ctime_ns=-1)

    def entry(self):
        """The manifest entry this row records."""
        return manifest_entry(self.kind, self.sha, self.size, self.mode, self.mtime_ns)


def index_row(info, kind, sha):
    return tuple.__new__(IndexRow, (info.size, info.mtime_ns, info.ctime_ns, info.ino, info.dev,
                                    info.mode, kind, sha))


def as_row(values):
    """An IndexRow of a stored row (checked by entries_ok before)."""
    return tuple.__new__(IndexRow, values)


# The state's counters of numbered records (steps, drifts, manifests).
RECORD_COUNTERS = ("last_step", "last_drift", "last_manifest")


# Record shapes. Every record read from the store is checked before it is
# used, so a damaged or hand-edited file is reported by name (StoreCorrupt)
# instead of failing somewhere later.
def _whole(value):
    return type(value) is int and value >= 0


def _text(value):
    return type(value) is str


def _texts(value):
    return type(value) is list and all(type(item) is str for item in value)


_HEX_DIGITS = b"0123456789abcdef"
_SHA_FORMS = {(KIND_SENSITIVE, type(None)), (KIND_FILE, str), (KIND_BIG, str)}
_KIND_AT = {5: operator.itemgetter(0), 8: operator.itemgetter(6)}
_SHA_AT = {5: operator.itemgetter(1), 8: operator.itemgetter(7)}


def hex_names(names):
    """True when every item is a 64-character lowercase hex string (checked
    for a whole table at once: these tables have a row per file)."""
    if set(map(len, names)) - {64}:
        return False
    joined = "".join(names)
    return joined.isascii() and not joined.encode("ascii").translate(None, _HEX_DIGITS)


def _whole_column(rows, at, top=None):
    values = list(map(operator.itemgetter(at), rows))
    return (not values or set(map(type, values)) == {int} and min(values) >= 0
            and (top is None or max(values) <= top))


def entries_ok(rows, width):
    """Manifest entries ([kind, sha, size, mode, mtime_ns], width 5) or index
    rows ([size, mtime, ctime, ino, dev, mode, kind, sha], width 8) as stored:
    lists of that width, a sha of the right form for the kind (a content
    name: it becomes a path in the store), sizes and modes whole numbers."""
    rows = list(rows)
    if set(map(type, rows)) - {list} or set(map(len, rows)) - {width}:
        return False
    shas = list(map(_SHA_AT[width], rows))
    if not set(zip(map(_KIND_AT[width], rows), map(type, shas))) <= _SHA_FORMS:
        return False
    size_at, mode_at = (2, 3) if width == 5 else (0, 5)
    return (hex_names([sha for sha in shas if sha is not None])
            and _whole_column(rows, size_at) and _whole_column(rows, mode_at, 0o7777))


_DRIVE = re.compile(r"^/[A-Za-z]:", re.M)


def rel_paths_ok(paths):
    """True when every item is a workspace-relative path in its normal form:
    no leading '/', no empty, '.' or '..' segment, no NUL (and on Windows
    no backslash or drive letter); checked for a whole table at once."""
    paths = list(paths)
    if not paths:
        return True
    if set(map(type, paths)) != {str}:
        return False
    wrapped = "/" + "/\n/".join(paths) + "/"
    if "//" in wrapped or "/./" in wrapped or "/../" in wrapped or "\x00" in wrapped:
        return False
    # A name like "c:notes" is an ordinary name on POSIX, a drive on Windows.
    return os.sep != "\\" or not ("\\" in wrapped or _DRIVE.search(wrapped))


STATE_SHAPE = ({"task_id": _text, "name": _text, "goal": _text, "constraints": _text,
                "root": _text, "status": lambda v: v in ("open", "suspended", "closed"),
                "exclude": _texts, "head": _whole, "last_step": _whole, "last_drift": _whole,
                "last_manifest": _whole},
               {"head_manifest": _whole, "index_manifest": _whole, "created": _text,
                "updated": _text, "agent": agent_ok})
STEP_SHAPE = ({"index": lambda v: _whole(v) and 1 <= v <= MAX_STEP, "title": _text,
               "manifest": _whole},
              {"description": _text, "conclusion": _text, "next": _text, "verified": _texts,
               "open_questions": _texts, "drift_id": lambda v: v is None or _text(v),
               "groups": lambda v: type(v) is list, "created": _text, "created_ns": _whole,
               "unseen": _texts, "agent": agent_ok, "head_before": _whole, "names": _whole})
DRIFT_SHAPE = ({"id": _text, "kind": _text, "manifest": _whole, "added": _texts,
                "modified": _texts, "deleted": _texts, "created_ns": _whole},
               {"partial": lambda v: type(v) is bool, "compressed": lambda v: type(v) is bool,
                "unrestorable": _texts, "head_before": lambda v: v is None or _whole(v),
                "reason": lambda v: v is None or _text(v), "created": _text,
                "unseen": _texts, "agent": agent_ok, "label": _text, "names": _whole,
                "paths": _texts})
MANIFEST_SHAPE = ({"full": lambda v: type(v) is bool},
                  {"n": _whole, "depth": _whole, "base": _whole,
                   "files": lambda v: (type(v) is dict and rel_paths_ok(v)
                                       and entries_ok(v.values(), 5)),
                   "changes": lambda v: (type(v) is dict and rel_paths_ok(v)
                                         and entries_ok(filter(None, v.values()), 5))})


def shape_problem(doc, shape):
    """None when doc is an object whose fields fit shape (required, optional);
    otherwise what does not fit, in a few words."""
    if type(doc) is not dict:
        return "not a JSON object"
    required, optional = shape
    for key, fits in required.items():
        if key not in doc:
            return "%s is missing" % key
        if not fits(doc[key]):
            return "%s has the wrong form" % key
    for key, fits in optional.items():
        if key in doc and not fits(doc[key]):
            return "%s has the wrong form" % key
    return None


def checked_record(doc, shape, path):
    """doc when it fits shape; otherwise StoreCorrupt naming the file."""
    problem = shape_problem(doc, shape)
    if problem is not None:
        raise StoreCorrupt("store file %r is damaged (%s); restore it from a backup or "
                           "remove the task" % (path, problem))
    return doc


class ManifestLog:
    """manifest/mNNNN.json of one task; loads full maps with a small cache."""

    CACHE_SIZE = 1  # the newest manifest: the base of the next delta

    def __init__(self, directory):
        self.directory = directory
        self._cache = {}

    def path(self, number):
        return os.path.join(self.directory, "m%04d.json" % number)

    @gc_paused
    def load(self, number):
        """The full {path: entry} map of manifest number (0 is the empty map)."""
        if not number:
            return {}
        cached = self._cache.get(number)
        if cached is not None:
            return cached
        path = self.path(number)
        try:
            doc = checked_record(read_json(path), MANIFEST_SHAPE, path)
        except FileNotFoundError:
            raise StoreCorrupt("manifest %r is missing; the store is damaged" % path) from None
        part = "files" if doc["full"] else "changes"
        if part not in doc or not (doc["full"] or doc.get("base", number) < number):
            raise StoreCorrupt("store file %r is damaged (no %s); restore it from a backup "
                               "or remove the task" % (path, "files" if doc["full"] else
                                                       "base before it"))
        if doc["full"]:
            result = {p: as_entry(e) for p, e in doc["files"].items()}
        else:
            result = dict(self.load(doc["base"]))
            for path, entry in doc["changes"].items():
                if entry is None:
                    result.pop(path, None)
                else:
                    result[path] = as_entry(entry)
        self._remember(number, result)
        return result

    def forget(self):
        self._cache.clear()

    def depth(self, number):
        if not number:
            return ANCHOR_EVERY
        return read_json(self.path(number)).get("depth", 0)

    def _remember(self, number, result):
        while len(self._cache) >= self.CACHE_SIZE:
            self._cache.pop(next(iter(self._cache), None), None)
        self._cache[number] = result

    def append(self, number, new_map, *, base, later=None):
        """Write manifest number as a delta on base, or a full anchor when due."""
        base_map = self.load(base) if base else {}
        depth = self.depth(base) + 1 if base else ANCHOR_EVERY
        # Entries are tuples: json writes them as arrays, and write_record sorts the keys.
        if depth >= ANCHOR_EVERY:
            doc = {"n": number, "full": True, "depth": 0, "files": new_map}
        else:
            changes = {p: e for p, e in new_map.items() if base_map.get(p) != e}
            changes.update({p: None for p in base_map if p not in new_map})
            doc = {"n": number, "full": False, "depth": depth, "base": base,
                   "changes": changes}
        write_record(self.path(number), doc, later)
        self._remember(number, dict(new_map))
        return self.path(number)


def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def make_state(*, task_id, name, goal, constraints, root, exclude, agent=None):
    return with_agent({
        "format": 1, "task_id": task_id, "name": name, "goal": goal,
        "constraints": constraints, "root": root, "status": "open",
        "exclude": list(exclude), "created": now_iso(), "updated": now_iso(),
        "head": 0, "last_step": 0, "last_drift": 0, "last_manifest": 0,
        "head_manifest": 0,
    }, agent)


# The name rules a record's scan applied (PathPolicy): 2 is the rule of a
# folder's name at any depth or a top-level file's; a record without it
# was made when a pattern also left out deeper files named like it; one
# with 2, when the always-excluded names left out what git tracks too. Such
# files may be missing from an older record without having been gone (see
# PathPolicy.left_out_before).
NAME_RULES = 3


def make_step(*, index, title, description, conclusion, next_step, verified,
              open_questions, manifest, drift_id, groups, unseen=(), agent=None,
              head_before=None):
    """head_before: the head the step was saved on (what a retried save
    based on that head repeats, see Saving.save)."""
    step = with_unseen({
        "index": index, "title": title, "description": description,
        "conclusion": conclusion, "next": next_step, "verified": list(verified),
        "open_questions": list(open_questions), "manifest": manifest,
        "drift_id": drift_id, "groups": groups, "names": NAME_RULES,
        "created": now_iso(), "created_ns": time.time_ns(),
    }, unseen)
    if head_before is not None:
        step["head_before"] = head_before
    return with_agent(step, agent)


def make_drift(*, number, kind, manifest, added, modified, deleted, partial=False,
               head_before=None, reason=None, unseen=(), agent=None, label=None,
               paths=None):
    """A drift record; label (a capture's own words, e.g. the command a hook
    saw about to run) is stored only when given. paths: the paths a restore
    of some paths changed (its recovered record holds them as they were,
    and restoring it restores only them); None for a record of the whole
    workspace."""
    drift = with_agent(with_unseen({
        "id": "d%04d" % number, "kind": kind, "manifest": manifest,
        "added": added, "modified": modified, "deleted": deleted,
        "partial": partial, "compressed": False, "unrestorable": [],
        "head_before": head_before, "reason": reason, "names": NAME_RULES,
        "created": now_iso(), "created_ns": time.time_ns(),
    }, unseen), agent)
    if label:
        drift["label"] = label
    if paths is not None:
        drift["paths"] = list(paths)
    return drift


def with_agent(record, agent):
    """record, with "agent" naming who made it (a label checked by
    validate_agent) when the call that made it said."""
    if agent:
        record["agent"] = agent
    return record


def with_unseen(record, unseen):
    """record, listing under "unseen" the paths its snapshot could not read
    (folders end in "/"): their entries are only the last known ones, so a
    restore to the record leaves them alone."""
    if unseen:
        record["unseen"] = sorted(unseen)
    return record


# Why plan_restore leaves alone a file the name rules of an older record
# left out (see older_names).
OLDER_NAMES_REASON = "recorded before files so named were recorded: left as it is"


def older_names(record):
    """The skipped item that marks a record made before NAME_RULES (path ""
    names no file; "names" the rules it was made with): plan_restore then
    leaves alone the files those rules left out. None for a current one."""
    names = record.get("names", 0)
    if not isinstance(names, int) or names >= NAME_RULES:
        return None
    return {"path": "", "reason": OLDER_NAMES_REASON, "names": names}


def unseen_skips(record):
    """The record's unseen paths as the skipped items plan_restore leaves
    alone; for a record made before NAME_RULES, older_names's item too."""
    items = [{"path": path.rstrip("/"), "reason": "not read when this record was made"}
             for path in record.get("unseen") or ()]
    marker = older_names(record)
    if marker is not None:
        items.append(marker)
    return items


def rewritten_as_recorded(row, sha, st):
    """Whether st is a file put back with the content sha that the index
    row records, under another stat than row's (putting it back moved it)."""
    if row is None or row.sha != sha or st is None or not stat_mod.S_ISREG(st.st_mode):
        return False
    return st.st_size == row.size and (st.st_mtime_ns, st.st_ctime_ns, st.st_ino) != (
        row.mtime_ns, row.ctime_ns, row.ino)


class TaskRecords:
    """Paths and plain reads/writes of one task's records."""

    def __init__(self, store_dir, task_id):
        self.task_id = task_id
        self.directory = os.path.join(store_dir, "tasks", task_id)
        self.manifests = ManifestLog(os.path.join(self.directory, "manifest"))
        self._index_cache = (None, None)
        self._derived = {}
        self.index_error = None  # why the index file did not parse, if it did not

    @property
    def state_path(self):
        return os.path.join(self.directory, "state.json")

    @property
    def index_path(self):
        return os.path.join(self.directory, "index.json")

    def exists(self):
        return os.path.isfile(self.state_path)

    def step_path(self, index):
        return os.path.join(self.directory, "steps", "s%04d.json" % index)

    def drift_path(self, number):
        return os.path.join(self.directory, "drifts", "d%04d.json" % number)

    def read_state(self):
        try:
            return checked_record(read_json(self.state_path), STATE_SHAPE, self.state_path)
        except FileNotFoundError:
            raise NotFound("task %r does not exist in this store" % self.task_id) from None

    def write_state(self, state):
        state["updated"] = now_iso()
        write_record(self.state_path, state)

    def write_state_with(self, state, flush):
        """write_state, with the new state file's own fsync in the batch that
        flush(later) makes durable: the state's bytes are on disk together
        with the records it points at, and only then does its name move
        (rename, then an fsync of the directory). One disk wait fewer than
        flush followed by write_state, the same order of what becomes visible.

        A flush refused before the rename fails the call with the old state
        in place. A refused fsync of the directory after the rename fails the
        call too, though the new state may already be read: it may not last."""
        state["updated"] = now_iso()
        staged = stage_record(self.state_path, state)
        try:
            flush([staged])
            replace_record(staged, self.state_path)
        except BaseException as exc:
            remove_file(staged)
            if isinstance(exc, OSError) and exc.filename == staged:
                raise named_after(exc, self.state_path) from None
            raise
        fsync_dir(os.path.dirname(self.state_path), strict=True)

    @property
    def receipt_path(self):
        """Present only while the last restore's read-back found files that
        are not as it wrote them; the next save removes it."""
        return os.path.join(self.directory, "receipt.json")

    def read_receipt(self):
        """The mismatches a restore's read-back left on record, or None."""
        try:
            doc = read_json_or(self.receipt_path, None)
        except (StoreCorrupt, OSError):
            doc = {}
        if doc is None:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("mismatched"), list):
            return {"recovered": None, "count": 1, "mismatched": [
                {"path": self.receipt_path, "reason": "this record of them is damaged"}]}
        return doc

    def clear_receipt(self):
        if os.path.lexists(self.receipt_path):
            remove_file(self.receipt_path)

    def check_step_number(self, index, last_step):
        """NotFound, before any file is named after it, for a step number
        the task has never given out (a number is shown whole only while
        it is one a step can have)."""
        if not last_step:
            raise NotFound("task %r has no steps yet: tc_save records the first one"
                           % self.task_id)
        if not 1 <= index <= last_step:
            shown = ("%d" % index if -MAX_STEP <= index <= MAX_STEP
                     else "numbered beyond %d" % MAX_STEP)
            raise NotFound("task %r has no step %s (steps are 1..%d)"
                           % (self.task_id, shown, last_step))

    def read_step(self, index):
        path = self.step_path(index)
        try:
            return checked_record(read_json(path), STEP_SHAPE, path)
        except FileNotFoundError:
            raise NotFound("task %r has no step %d" % (self.task_id, index)) from None

    def read_drift(self, drift_id):
        number = int(drift_id[1:])
        path = self.drift_path(number)
        try:
            return checked_record(read_json(path), DRIFT_SHAPE, path)
        except FileNotFoundError:
            raise NotFound("task %r has no drift record %r" % (self.task_id, drift_id)) from None

    def _numbers(self, sub, prefix):
        try:
            names = os.listdir(os.path.join(self.directory, sub))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for name in names:  # only the names records get (sNNNN.json): no stray lookalike
            digits = name[len(prefix):-5]
            if (name.startswith(prefix) and name.endswith(".json") and digits.isascii()
                    and digits.isdigit() and int(digits) > 0
                    and name == "%s%04d.json" % (prefix, int(digits))):
                out.append(int(digits))
        return sorted(out)

    def step_numbers(self):
        return self._numbers("steps", "s")

    def drift_numbers(self):
        return self._numbers("drifts", "d")

    def numbered_records(self):
        """{state counter: (numbers of the records on disk, path of a number)}
        for the steps, drifts and manifests."""
        return {"last_step": (self.step_numbers(), self.step_path),
                "last_drift": (self.drift_numbers(), self.drift_path),
                "last_manifest": (self._numbers("manifest", "m"), self.manifests.path)}

    @gc_paused
    def read_index(self):
        """{"stamp_ns", "files": {rel: IndexRow}}.

        index.json holds the table as of its last full write; index.log
        holds the changes since, one JSON line per write (see write_index).
        The parsed result is kept while both files keep their identity
        (inode, size, mtime), so a write by any process is seen. Callers
        must not mutate the returned document.
        """
        try:
            st = os.stat(self.index_path)
        except FileNotFoundError:
            self.index_error = None
            return {"stamp_ns": 0, "files": {}}
        key = self._index_key(st)
        cached_key, cached = self._index_cache
        if cached_key == key:
            return cached
        try:
            doc = read_json_or(self.index_path, None) or {"stamp_ns": 0, "files": {}}
            if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
                raise StoreCorrupt("index %r has no file table" % self.index_path)
        except StoreCorrupt as exc:
            # Only a stat cache: without it every file is read again and the
            # next write replaces it. tc_resume's health reports the damage.
            self.index_error = str(exc)
            return {"stamp_ns": 0, "files": {}}
        if key[1] is not None:
            self._apply_index_log(doc)
        if type(doc.get("stamp_ns", 0)) is not int or not entries_ok(doc["files"].values(), 8):
            # Only a stat cache: without it every file is read again.
            self.index_error = "index %r is damaged" % self.index_path
            return {"stamp_ns": 0, "files": {}}
        doc["files"] = {rel: as_row(row) for rel, row in doc["files"].items()}
        self.index_error = None
        self._index_cache = (key, doc)
        return doc

    def _index_key(self, st=None):
        """Identity of index.json and index.log together (None parts: missing)."""
        try:
            st = st or os.stat(self.index_path)
            base = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_dev)
        except FileNotFoundError:
            base = None
        try:
            lst = os.stat(self.index_log_path)
            log = (lst.st_ino, lst.st_size, lst.st_mtime_ns)
        except FileNotFoundError:
            log = None
        return base, log

    def _apply_index_log(self, doc):
        """Replay index.log onto its base; stops at the first line that does not
        parse or belongs to another base (a torn append, or a log left beside
        a newer base). doc["log_ok"] says whether every line applied."""
        files, gen, ok = doc["files"], doc.get("gen"), True
        try:
            with open(self.index_log_path, "rb") as fh:
                lines = fh.read().split(b"\n")
        except OSError:
            lines = []
        if lines and lines[-1] == b"":
            lines.pop()
        for line in lines:
            try:
                change = parse_json(line)
                if gen is None or change["gen"] != gen:
                    raise ValueError("another base")
                files.update(change["set"])
                for rel in change["del"]:
                    files.pop(rel, None)
                doc["stamp_ns"] = change["stamp_ns"]
            except (ValueError, KeyError, TypeError, AttributeError):
                ok = False
                break
        doc["log_ok"] = ok

    @property
    def index_log_path(self):
        return os.path.join(self.directory, "index.log")

    @property
    def left_out_path(self):
        return os.path.join(self.directory, "left_out.json")

    def read_left_out(self):
        """{rel: kind} of what the task's saves have reported as left out of
        its records (see Recorder.newly_left_out); {} when not known."""
        try:
            doc = read_json_or(self.left_out_path, {})
        except (OSError, StoreCorrupt):
            return {}
        paths = doc.get("paths") if isinstance(doc, dict) else None
        return dict(paths) if isinstance(paths, dict) else {}

    def write_left_out(self, paths):
        """Remember what was reported as left out. A cache: when it is lost,
        the next save reports everything again."""
        try:
            write_json(self.left_out_path, {"paths": paths}, durable=False)
        except OSError:
            pass

    def write_index(self, index_doc, entries=None, *, whole=False):
        """Record index_doc as the index; entries, when given, are its recorded
        entries (what index_entries would compute), kept for the next call.

        When this process holds the index as it is on disk, only the rows
        that changed are appended to index.log, until the log outgrows a
        quarter of index.json; then (or with whole=True) index.json is
        rewritten and the log removed. A stat cache: nothing here is
        fsync'd, and losing it only costs re-reading files.
        """
        cached_key, old = self._index_cache
        self._index_cache = (None, None)
        rows = index_doc["files"]
        key = self._index_key() if (old is not None and not whole) else None
        if (key is not None and key == cached_key and old.get("gen")
                and old.get("log_ok", True)):
            old_rows = old["files"]
            changed = {rel: row for rel, row in rows.items()
                       if old_rows.get(rel) is not row and old_rows.get(rel) != row}
            gone = ([rel for rel in old_rows if rel not in rows]
                    if len(old_rows) + len(changed) != len(rows) else [])
            line = dump_json({"gen": old["gen"], "stamp_ns": index_doc["stamp_ns"],
                              "set": changed, "del": gone}, sort_keys=False) + b"\n"
            log_size = key[1][1] if key[1] else 0
            if log_size + len(line) <= max(key[0][1] // 4, 65536):
                try:
                    with open(self.index_log_path, "ab") as fh:
                        fh.write(line)
                except OSError:
                    pass  # whatever is in the way, a whole write below replaces it
                else:
                    index_doc["gen"], index_doc["log_ok"] = old["gen"], True
                    self._keep_index(index_doc, entries)
                    return
        index_doc["gen"] = random_hex(8)
        index_doc.pop("log_ok", None)
        write_json(self.index_path, index_doc, durable=False, sort_keys=False)
        try:
            remove_file(self.index_log_path)
        except OSError:  # not a file: its lines can never match this base anyway
            pass
        self._keep_index(index_doc, entries)

    def settle_put_back(self, root, back):
        """After a rollback put files back (back: {rel: the sha it put back}
        under root): the index rows of those files get their new size, mtime
        and inode, so tc_resume does not list them as unsaved work (they hold
        what their rows say). Their ctime is one no file has, so the next
        scan still reads them (see carry_unknown). Only a stat cache."""
        doc = self.read_index()
        files = dict(doc["files"])
        for rel, sha in back.items():
            row = files.get(rel)
            st = lstat_or_none(os.path.join(root, *rel.split("/")))
            if rewritten_as_recorded(row, sha, st):
                files[rel] = row._replace(size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=-1,
                                          ino=st.st_ino, dev=st.st_dev)
        if files != doc["files"]:
            self.write_index({"stamp_ns": doc.get("stamp_ns", 0), "files": files}, whole=True)

    def _keep_index(self, index_doc, entries):
        # What was just written is what a read would parse: keep it.
        self._index_cache = (self._index_key(), index_doc)
        self.index_error = None
        if entries is not None:
            self._derived = {"doc": index_doc, "entries": entries}

    def _derive(self, doc, name, build):
        """A map computed from an index document once, while it is the current one."""
        if self._derived.get("doc") is not doc:
            self._derived = {"doc": doc}
        value = self._derived.get(name)
        if value is None:
            value = self._derived[name] = build(doc["files"])
        return value

    def index_entries(self, doc):
        """{rel: manifest entry} of the files an index document records."""
        return self._derive(doc, "entries",
                            lambda files: {rel: row.entry() for rel, row in files.items()})


# ---------------------------------------------------------------------------
# 9. Journal and Rollback: workspace changes that can always be undone
# ---------------------------------------------------------------------------

CHANGED_MEANWHILE_TEXT = "changed by something else while the %s ran; left as it is"

LEFT_LIST_NAME = "left"  # in a journal's folder: one JSON string (a path) a line
# In a journal's folder: {"only", "rewritten"} of an in-process rollback (see
# Journal.rollback), which a retry of that rollback keeps to.
ROLLBACK_SCOPE_NAME = "rollback.json"


class Journal:
    """Backup, stage and apply workspace changes; roll back on any failure.

    The plan (every path the operation will touch, with the sha and mode it
    had before, all of whose content is already in the payload store) and
    copies of the store files it will overwrite are on disk before the first
    workspace byte changes. Until ``finish`` removes it, a journal found by
    anyone taking the store lock is abandoned and gets rolled back.
    """

    def __init__(self, store, op, root):
        self.store = store
        self.op_id = "%s-%d-%s" % (op, os.getpid(), random_hex(4))
        self.directory = os.path.join(store.directory, "journal", self.op_id)
        # Staging names of the entries are derived (temp_name), not listed;
        # new payloads are listed by sha.
        self.data = {"op": op, "op_id": self.op_id, "root": root, "entries": [],
                     "created_dirs": [], "store_new": [],
                     "store_new_dirs": [], "store_backup": {}, "payloads_new": []}
        try:  # the folder holding the workspace: whether a missing one was removed
            parent = os.stat(os.path.dirname(root))
            self.data["parent_id"] = [parent.st_dev, parent.st_ino]
        except OSError:
            pass
        if _inside(store.directory, root):  # the workspace is wherever its store is
            self.data["store_rel"] = os.path.relpath(store.directory, root)
        self.started = False
        self._left = {}  # rel -> why it is left as it is (see leave)
        self._touched = set()  # paths the operation began to change (see touch)
        self._done = {}  # rel -> (size, mtime) it was left with, None once removed
        self._left_lock = threading.Lock()

    def add_entry(self, rel, before, after=None):
        """Plan to change rel; before is (sha, mode) of its current content or
        None; after, the sha the operation writes there (None: it deletes)."""
        self.data["entries"].append([rel, list(before) if before else None, after])

    def add_store_new(self, path):
        self.data["store_new"].append(os.path.relpath(path, self.store.directory))

    def backup_store_file(self, path):
        rel = os.path.relpath(path, self.store.directory)
        if rel in self.data["store_backup"]:
            return
        os.makedirs(self.directory, exist_ok=True)
        if os.path.isfile(path):
            name = "backup-%d" % len(self.data["store_backup"])
            import shutil  # only here: a restore's backup of a store record
            shutil.copyfile(path, os.path.join(self.directory, name))
            self.data["store_backup"][rel] = name
        else:
            self.data["store_backup"][rel] = None

    def begin(self, payloads_new=(), *, discard=None):
        """Write the plan; payloads_new: paths of payloads the operation added.
        If that fails (a flush the disk refuses), the journal never started:
        its folder is removed, and so are the payloads in discard (stored for
        this operation, named by nothing yet), before the error goes up."""
        try:
            self._write_plan(payloads_new)
        except BaseException:
            remove_tree(self.directory)
            if discard and not os.path.lexists(os.path.join(self.directory, "plan.json")):
                self.store.payloads.discard(discard)
            raise

    def _write_plan(self, payloads_new):
        """The new payloads, the store backups and the plan's own bytes are
        made durable in one batch; only then does the plan get its name."""
        self.data["payloads_new"] = sorted({os.path.basename(p) for p in payloads_new})
        os.makedirs(self.directory, exist_ok=True)
        plan = os.path.join(self.directory, "plan.json")
        staged = stage_record(plan, self.data)
        backups = [os.path.join(self.directory, name)
                   for name in sorted(set(self.data["store_backup"].values()) - {None})]
        try:
            self.store.payloads.flush_with(backups + [
                staged, self.directory, os.path.dirname(self.directory)])
            replace_record(staged, plan)
        except BaseException as exc:
            remove_file(staged)
            if isinstance(exc, OSError) and exc.filename == staged:
                raise named_after(exc, plan) from None
            raise
        fsync_dir(self.directory, strict=True)
        self.started = True

    def temp_name(self, full):
        """A short staging name beside full (long file names stay within limits)."""
        return sibling_temp(full, self.op_id)

    def finish(self):
        # The plan goes first: a journal without its plan is never rolled back.
        remove_file(os.path.join(self.directory, "plan.json"))
        fsync_dir(self.directory)
        remove_tree(self.directory)
        fsync_dir(os.path.dirname(self.directory))
        remove_empty_dir(os.path.dirname(self.directory))

    def touch(self, rel):
        """Note, before the operation changes rel in the workspace, that it
        does: an in-process rollback puts back only such paths, so that a
        file the operation never reached keeps whatever another program
        wrote to it meanwhile."""
        with self._left_lock:
            self._touched.add(rel)

    def done(self, rel, st):
        """Note that the operation is through with rel: written (st: its stat
        after), removed (st None), or given up on with what a failed write
        left there (st: its stat then); see rollback."""
        with self._left_lock:
            self._done[rel] = None if st is None else (st.st_size, st.st_mtime_ns)

    def failed_on(self, rel, full):
        """done(), for a write of full that failed: what it left there, so a
        rollback tells a later write by another program from its own."""
        try:
            self.done(rel, lstat_or_none(full))
        except OSError:  # nothing to tell by: the rollback takes it for its own
            pass

    def leave(self, rel, reason=None):
        """Note that the operation leaves rel as it is (by default: another
        program wrote it after the plan was made): no rollback puts it back,
        in this process or after a crash. Durable before the operation goes
        on; each line starts a line of its own, so one a crash cut short
        spoils no other."""
        with self._left_lock:
            if rel in self._left:
                return
            self._left[rel] = reason or CHANGED_MEANWHILE_TEXT % self.data["op"]
            path = os.path.join(self.directory, LEFT_LIST_NAME)
            new = not os.path.exists(path)
            with open(path, "ab") as fh:
                fh.write(b"\n" + json.dumps(rel).encode("ascii") + b"\n")
                fh.flush()
                os.fsync(fh.fileno())
            if new:
                fsync_dir(self.directory, strict=True)

    @property
    def left(self):
        """The paths the operation left as they are, sorted."""
        with self._left_lock:
            return sorted(self._left)

    def left_paths(self):
        """[{"path", "reason"}] of the paths the operation left as they are."""
        with self._left_lock:
            return [{"path": rel, "reason": self._left[rel]} for rel in sorted(self._left)]

    def rollback(self):
        """Roll back in this process, after a failure: only the paths the
        operation began to change. One that another program wrote after the
        operation was through with it stays as that program left it; what
        it held before the operation stays in the store (kept/), and it is
        named among the paths not put back."""
        with self._left_lock:
            touched, done = set(self._touched), dict(self._done)
        root = os.path.realpath(workspace_now(self.store.directory, self.data))
        rewritten = set()
        for rel, was in done.items():
            try:
                st = lstat_or_none(os.path.join(root, *rel.split("/")))
            except OSError:
                continue
            # Only a file: a folder there is the operation's own (a file it
            # removed made way for one), and a file gone is simply put back.
            if st is not None and stat_mod.S_ISREG(st.st_mode) and (
                    st.st_size, st.st_mtime_ns) != was:
                rewritten.add(rel)
        try:  # should this rollback fail, the one retried at the next lock keeps to the same
            write_json(os.path.join(self.directory, ROLLBACK_SCOPE_NAME),
                       {"only": sorted(touched), "rewritten": sorted(rewritten)}, strict=True)
        except OSError as exc:
            self.store.log("rollback of %s: its scope could not be noted (%s); a retry goes "
                           "through every file" % (self.op_id, describe_os_error(exc)))
        return Rollback(self.store, self.directory, self.data, left=self.left, only=touched,
                        rewritten=rewritten).run()


def _holds_already(full, sha, mode, guard):
    """True when the regular file full (inside the workspace) holds sha; it
    is then given mode too. False when it holds other bytes or is no such file."""
    try:
        fh, st = open_regular(full)
        with fh:
            opened_within(fh.fd, st, None, guard, full)
            digest = hashlib.sha256()
            for block in fh.blocks():
                digest.update(block)
            if digest.hexdigest() != sha:
                return False
            if stat_mod.S_IMODE(st.st_mode) != mode:
                if hasattr(os, "fchmod"):
                    os.fchmod(fh.fd, mode)
                else:
                    os.chmod(full, mode)
            return True
    except OSError:
        return False


def _make_way(full, guard):
    """Before a file is put back at full: an empty folder there gives way
    (the operation's own folders are gone by now) and its folders are made.
    PathTaken when a folder with something in it, or a file on the way,
    stands there."""
    if os.path.isdir(full) and not os.path.islink(full):
        try:
            rmdir_within(full, guard)
        except OSError:
            pass
        if os.path.isdir(full) and not os.path.islink(full):
            raise PathTaken("a folder with something in it is there now")
    try:
        make_dirs_within(os.path.dirname(full), guard)
    except (FileExistsError, NotADirectoryError):
        raise PathTaken("one of its folders is a file now") from None


def _put_back(payloads, full, before, guard):
    """Make full hold (sha, mode) again; a no-op when it already does."""
    sha, mode = before
    if _holds_already(full, sha, mode, guard):
        return
    _make_way(full, guard)
    tmp = sibling_temp(full, "rollback")
    remove_within(tmp, guard)
    try:
        try:
            payloads.copy_out(sha, tmp, mode, within=guard)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # A full disk: the wrong bytes at full give their room to the right ones.
            remove_within(tmp, guard)
            remove_within(full, guard)
            payloads.copy_out(sha, tmp, mode, within=guard)
        replace_within(tmp, full, guard)
    except OSError as exc:
        try:
            remove_within(tmp, guard)
        except (OSError, UnsafePath):
            pass
        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):  # taken meanwhile
            raise PathTaken("a folder is there now") from None
        if exc.filename == tmp:
            raise named_after(exc, full) from None
        raise


def read_rollback_scope(directory):
    """(only, rewritten) an in-process rollback of this journal noted, or
    (None, ()) when it noted none (or what it noted does not read)."""
    try:
        doc = read_json(os.path.join(directory, ROLLBACK_SCOPE_NAME))
        only, rewritten = doc["only"], doc["rewritten"]
        if (isinstance(only, list) and isinstance(rewritten, list) and rel_paths_ok(only)
                and rel_paths_ok(rewritten)):
            return set(only), set(rewritten)
    except (OSError, StoreCorrupt, KeyError, TypeError, AttributeError):
        pass
    return None, ()


def read_left_list(directory):
    """The paths a journal's operation left as they were (Journal.leave);
    a line a crash cut short is passed over."""
    try:
        with open(os.path.join(directory, LEFT_LIST_NAME), "rb") as fh:
            lines = fh.read().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return set()
    left = set()
    for line in lines:
        try:
            rel = json.loads(line)
        except ValueError:
            continue
        if isinstance(rel, str):
            left.add(rel)
    return left


JournalEntry = collections.namedtuple("JournalEntry", "rel before after planned")
JournalEntry.__doc__ = """One path of a journal's plan: rel, the [sha, mode] it held before
the operation (None: the operation made it), after, the sha the operation
writes there (None: it deletes it), and planned, False for an entry of an
older plan, which did not note after."""


def journal_entry(entry):
    """The JournalEntry of a plan's [rel, before, after] list."""
    return JournalEntry(entry[0], entry[1], entry[2] if len(entry) > 2 else None,
                        len(entry) > 2)


def workspace_now(store_dir, plan):
    """Where a journal's workspace is now: with the store inside it, the
    folder that holds the store (the workspace may have been renamed with
    it); otherwise the path it had."""
    rel = plan.get("store_rel")
    if not rel:
        return plan["root"]
    up = store_dir
    for _part in rel.split(os.sep):
        up = os.path.dirname(up)
    return up


class KeptList:
    """kept/<op_id>.json in the store: the content a rollback keeps because
    it could not (or must not) put it back, which clean-ups count as a
    record. "files": what files held before the operation; "edited": what
    they held when the rollback found them changed since the operation
    wrote them (edits made after a crash). Each {rel: [sha, mode]}."""

    def __init__(self, store, op, op_id, root):
        self.store, self.op, self.root = store, op, root
        self.path = os.path.join(store.directory, KEPT_DIRNAME, op_id + ".json")

    def read(self):
        """(files, edited) an earlier run of this rollback listed; empty when
        there is none (or it does not read)."""
        try:
            doc = read_json(self.path)
        except (OSError, StoreCorrupt):
            return {}, {}
        parts = [doc.get(key) if isinstance(doc, dict) else None for key in ("files", "edited")]
        return tuple(dict(part) if isinstance(part, dict) else {} for part in parts)

    def write(self, files, edited=None):
        """Add files and edited to what the list holds; its path."""
        old_files, old_edited = self.read()
        old_files.update(files)
        old_edited.update(edited or {})
        doc = {"op": self.op, "root": self.root, "files": old_files, "kept": now_iso()}
        if old_edited:
            doc["edited"] = old_edited
        write_json(self.path, doc, strict=True)
        return self.path

    def shas(self):
        """Every sha the list names."""
        return {entry[0] for part in self.read() for entry in part.values()
                if isinstance(entry, list) and entry}


class Rollback:
    """Undo one journaled operation; safe to run more than once, and again
    after a crash part-way through it.

    The passes, in order (run):
    1. keep_edits, only for an operation that died (found at a later lock):
       what each journaled file holds when it is neither its old content nor
       what the operation wrote is stored and listed first (KeptList), so
       edits made between the crash and the rollback are never lost;
    2. remove_what_was_made: the operation's new files, staging files and
       folders go, so none of them stands where a file goes back;
    3. put_back_all: every file that existed before gets its content back;
       one that cannot (its folder now leads outside the workspace,
       something was made at its path since, its copy is damaged) is
       logged and passed over, its content kept in the store;
    4. roll_back_records: the store records the operation added go, the
       ones it replaced come back;
    5. settle_index_rows: the stat cache learns the new stat of the files
       put back, so tc_resume does not list them as unsaved work;
    6. finish: the plan goes first, then the operation's new content (but
       what a file not put back still needs), then the journal.
    When the workspace is gone, only the records are rolled back and the
    content its files had is kept; when it may come back (an unmounted
    disk), the rollback waits. Deleting its journal folder gives that
    rollback up, and the unsaved edits it would put back with it.

    Paths the operation left as they were (left, and those its journal
    lists) are not the rollback's to touch. For an operation that failed
    in this process: only, the paths it began to change; rewritten, those
    another program wrote after the operation was through with them,
    which stay as they are. A rollback retried at a later lock reads the
    same scope from the journal (Journal.rollback notes it)."""

    def __init__(self, store, directory, plan, *, keep_edits=False, left=(), only=None,
                 rewritten=()):
        if only is None:
            only, rewritten = read_rollback_scope(directory)
        left = set(left) | read_left_list(directory)
        self.store, self.payloads, self.log = store, store.payloads, store.log
        self.directory = directory
        self.op, self.op_id = plan["op"], plan.get("op_id")
        self.root = workspace_now(store.directory, plan)
        self.parent_id = plan.get("parent_id")  # the folder that held the workspace
        self.task_id = plan.get("task_id")  # whose index the files belong to (restores)
        self.entries = [journal_entry(e) for e in plan["entries"] if e[0] not in left]
        self.undo = (self.entries if only is None
                     else [entry for entry in self.entries if entry.rel in only])
        self.rewritten = set(rewritten)
        self.after_crash = keep_edits
        self.created_dirs = plan["created_dirs"]
        self.temp_files = plan.get("temp_files", ())  # plans that listed their staging names
        self.store_new, self.store_new_dirs = plan["store_new"], plan.get("store_new_dirs", [])
        self.store_backup, self.payloads_new = plan["store_backup"], plan["payloads_new"]
        self.kept = KeptList(store, self.op, self.op_id or os.path.basename(directory),
                             self.root)
        self.edited = {}  # what keep_edits stored of files edited since (rel -> [sha, mode])

    @classmethod
    def of_journal(cls, store, directory, **kwargs):
        """The rollback of the journal in directory, or None for a journal
        that never started (its folder is removed)."""
        try:
            plan = read_json(os.path.join(directory, "plan.json"))
        except (FileNotFoundError, StoreCorrupt):
            remove_tree(directory)
            return None
        return cls(store, directory, plan, **kwargs)

    def run(self):
        """Roll back; the workspace paths that could not be put back."""
        there = self.workspace_state()
        if there == "away":
            raise StoreUnwritable(
                "the workspace %r of an interrupted %s is not there (its disk is not "
                "mounted?): its rollback waits until it is back. To give up that rollback, "
                "and the unsaved edits it would put back, delete %r"
                % (self.root, self.op, self.directory))
        stranded, not_back = set(), []
        if there == "here":
            stranded, not_back = self.roll_back_workspace()
        else:
            stranded = self.keep_undo_content()
        self.roll_back_records()
        if there == "here":
            self.settle_index_rows(not_back)
        self.finish(stranded)
        return not_back

    def workspace_state(self):
        """Where the workspace is: "here" to roll back into; "gone" when it
        was removed (the folder that held it is still the same folder), or
        is missing with nothing to put back, so only the records are rolled
        back; "away" when it may come back (a disk not mounted leaves
        nothing, or an empty mount point, where the files to put back must
        not be written), so the rollback waits."""
        root = self.root
        if _at_or_inside(self.store.directory, root):
            return "here"  # its store is read from inside it
        to_put_back = any(entry.before is not None for entry in self.entries)
        try:
            with os.scandir(root) as it:
                empty = next(it, None) is None
        except FileNotFoundError:
            if not to_put_back:
                return "gone"
            try:
                parent = os.stat(os.path.dirname(root))
            except OSError:
                return "away"
            same = [parent.st_dev, parent.st_ino] == self.parent_id
            return "gone" if same or self.parent_id is None else "away"
        except OSError:
            return "here"  # let the rollback meet the error and report it
        return "away" if empty and to_put_back else "here"

    def keep_undo_content(self):
        """For a workspace that was removed: the content its files had before
        the operation stays in the store, listed in the KeptList (so no
        clean-up takes it), in case the workspace was only moved. The shas
        kept."""
        files = {entry.rel: entry.before for entry in self.entries if entry.before is not None}
        if not files:
            self.log("rollback of %s: the workspace %r was removed; its records are rolled "
                     "back" % (self.op_id, self.root))
            return set()
        path = self.kept.write(files)
        self.log("rollback of %s: the workspace %r was not found; its records are rolled "
                 "back, and the content its %d file(s) had before the %s stays in the store, "
                 "listed in %r (file -> payload/<sha[:2]>/<sha>)"
                 % (self.op_id, self.root, len(files), self.op, path))
        return {before[0] for before in files.values()}

    def roll_back_workspace(self):
        """Passes 1 to 3; (the content that stays in the store, the paths not
        put back)."""
        # The folder may have moved since, with a link left at its old name.
        root = os.path.realpath(self.root)
        guard = kernel_path(root)
        edited, leave = self.keep_edits(root, guard) if self.after_crash else ({}, set())
        self.edited = edited
        self.remove_what_was_made(root, guard, leave | self.rewritten)
        kept, not_back = self.put_back_all(root, guard, leave)
        if kept:
            self.log("rollback of %s: the content of the %d file(s) not put back is listed in "
                     "%r (file -> payload/<sha[:2]>/<sha>)"
                     % (self.op_id, len(kept), self.kept.write(kept, edited)))
        # What this run or an earlier one cut short listed stays: none of it is
        # removed with the operation's new content.
        stays = {entry[0] for values in (kept.values(), edited.values()) for entry in values}
        return stays | self.kept.shas(), not_back

    def keep_edits(self, root, guard):
        """Pass 1: store what each journaled file holds when it is neither
        what it held before the operation nor what the operation wrote there,
        and list it (flushed first), even if the rollback itself is cut short
        (a write the crash cut off looks the same, and is kept too). An
        entry of an older plan has no after, and nothing is kept for it. A
        file now over MAX_CONTENT_BYTES (whose content is never stored) is
        not kept: the rollback leaves it where it is. ({rel: [sha, mode]}
        of what was kept, {rel} of the files to leave)."""
        edited, leave = {}, set()
        for entry in self.undo:
            if not entry.planned:
                continue
            try:
                full = safe_workspace_path(root, entry.rel)
                if os.lstat(full).st_size > MAX_CONTENT_BYTES:
                    leave.add(entry.rel)
                    continue
            except (OSError, UnsafePath):
                continue
            now = file_sha_within(full, guard)
            if now is not None and now != entry.after and (
                    entry.before is None or now != entry.before[0]):
                self.keep_edited(full, entry.rel, guard, edited)
        if edited:
            self.payloads.flush()
            path = self.kept.write({}, edited)
            self.log("rollback of %s: what %d file(s) held is kept, listed in %r"
                     % (self.op_id, len(edited), path))
        return edited, leave

    def keep_edited(self, full, rel, guard, edited):
        """Store what full holds now and note it in edited, before the
        rollback removes or rewrites it."""
        try:
            sha, _size, mode, _written = self.payloads.put_file(full, within=guard)
        except FileNotFoundError:
            return
        edited[rel] = [sha, mode]
        self.log("rollback: %r holds neither what it held before the interrupted %s nor what "
                 "the %s wrote (edited since, or a write the crash cut off); what it holds "
                 "stays in the store as %s" % (rel, self.op, self.op, self.payloads.path(sha)))

    def remove_what_was_made(self, root, guard, leave):
        """Pass 2: what the operation made goes (its files, its staging files,
        then its folders, deepest first; a folder that now holds anything
        stays). leave: paths to leave as they are."""
        temps = list(self.temp_files)
        for entry in self.undo:
            try:
                full = safe_workspace_path(root, entry.rel)
            except UnsafePath:
                continue
            if self.op_id:
                temps.append(sibling_temp(full, self.op_id))
            if entry.before is None and entry.rel not in leave and os.path.isfile(full):
                try:
                    remove_within(full, guard)
                except UnsafePath:  # now outside: not the rollback's to remove
                    pass
        for tmp in temps:
            if os.path.lexists(tmp):  # (an unlink on a read-only disk fails even then)
                remove_file(tmp)
        for rel in reversed(self.created_dirs):
            try:
                rmdir_within(os.path.join(root, rel), guard)
            except (OSError, UnsafePath):  # not empty, gone, or now outside: left alone
                pass

    def put_back_all(self, root, guard, leave):
        """Pass 3: every journaled file that existed before goes back to that
        content, last written first, but those in leave (edited past 100 MB)
        and the rewritten ones. (kept: rel -> its old [sha, mode] for each
        file not put back whose content stays in the store, every path not
        put back)."""
        kept, not_back = {}, []
        for entry in reversed(self.undo):
            rel, before = entry.rel, entry.before
            if before is None:
                if rel in self.rewritten:  # made by the operation, then written by another
                    not_back.append(rel)
                    self.log("rollback: %r, which the %s made, was not removed: another "
                             "program wrote it since, so it stays as it is" % (rel, self.op))
                continue
            if rel in self.rewritten:
                kept[rel] = before
                not_back.append(rel)
                self.log("rollback: %r was not put back: another program wrote it after the %s "
                         "did, so it stays as it is; what it held before stays in the store "
                         "as %s" % (rel, self.op, self.payloads.path(before[0])))
                continue
            if rel in leave:  # edited past what is ever stored: it stays as it is
                kept[rel] = before
                not_back.append(rel)
                self.log("rollback: %r was not put back: it was edited since the interrupted "
                         "%s and is now over %d MB, so it stays as it is; what it held before "
                         "stays in the store as %s" % (rel, self.op, MAX_CONTENT_BYTES >> 20,
                                                       self.payloads.path(before[0])))
                continue
            try:
                _put_back(self.payloads, safe_workspace_path(root, rel), before, guard)
            except (UnsafePath, PathTaken) as exc:  # nothing there is the rollback's to undo
                kept[rel] = before
                not_back.append(rel)
                why = ("its folder now leads outside the workspace"
                       if isinstance(exc, UnsafePath) else str(exc))
                self.log("rollback: %r was not put back, %s; its content stays in the store "
                         "as %s" % (rel, why, self.payloads.path(before[0])))
            except StoreCorrupt as exc:
                not_back.append(rel)
                self.log("rollback: %r was not put back: %s" % (rel, exc))
        return kept, not_back

    def roll_back_records(self):
        """Pass 4: remove the records the operation added; put back the ones
        it replaced."""
        store_dir = self.store.directory
        for rel in self.store_new:
            remove_file(os.path.join(store_dir, rel))
        for rel in self.store_new_dirs:
            remove_tree(os.path.join(store_dir, rel))
        for rel, backup in self.store_backup.items():
            target = os.path.join(store_dir, rel)
            if backup is None:
                remove_file(target)
                continue
            try:
                with open(os.path.join(self.directory, backup), "rb") as fh:
                    before = fh.read()
            except FileNotFoundError:  # damaged journal: keep the current file
                self.log("journal %s lacks its backup of %s" % (self.directory, rel))
                continue
            # A record the operation never got to change is left alone: on a
            # read-only or immutable file, writing it back would fail for nothing.
            if read_file_or_none(target) != before:
                atomic_write(target, before, strict=True)

    def settle_index_rows(self, not_back):
        """Pass 5: the files put back belong to a task's index (a restore's
        journal names the task): their rows learn their new stat (see
        TaskRecords.settle_put_back)."""
        back = {entry.rel: entry.before[0] for entry in self.undo
                if entry.before is not None and entry.rel not in not_back}
        if not self.task_id or not back:
            return
        try:
            self.store.task(self.task_id).settle_put_back(self.root, back)
        except (OSError, CheckpointError, ValueError, TypeError, KeyError) as exc:
            self.log("rollback of %s: the index rows of the files put back were left as they "
                     "were: %s" % (self.op_id, exc))

    def finish(self, stranded):
        """Pass 6, once workspace and records are back: the plan goes first,
        so a crash from here on leaves at most unreferenced content, never a
        rollback that cannot finish; then the operation's new content, but
        what the workspace's files need (stranded), and the journal."""
        remove_file(os.path.join(self.directory, "plan.json"))
        fsync_dir(self.directory)
        for item in self.payloads_new:
            if item in stranded:  # the only copy of a file that could not go back
                continue
            path = item if os.sep in item or "/" in item else self.payloads.path(item)
            remove_file(path)
            remove_empty_dir(os.path.dirname(path))
        self.store.forget_caches()
        remove_tree(self.directory)
        remove_empty_dir(os.path.dirname(self.directory))


def undo_failed_operation(log, journal, what, exc):
    try:
        not_back = journal.rollback()
    except Exception as failure:
        if isinstance(failure, OSError) and failure.errno in OS_ERROR_ADVICE:
            why = "%s. %s" % (describe_os_error(failure), OS_ERROR_ADVICE[failure.errno])
            log("rollback of %s failed: %s" % (what, why))
        elif isinstance(failure, OSError) and failure.errno in VANISHED_ERRNOS:
            why = ("%s (the workspace changed while it was rolled back)"
                   % describe_os_error(failure))
            log("rollback of %s failed: %s" % (what, why))
        elif isinstance(failure, CheckpointError):
            why = str(failure)
            log("rollback of %s failed: %s" % (what, why))
        else:  # unexpected: the log gets the traceback
            why = "%s (details in server.log)" % (describe_os_error(failure)
                                                  if isinstance(failure, OSError)
                                                  else type(failure).__name__)
            log("rollback of %s failed: %s" % (what, traceback_text()))
        first = describe_os_error(exc) if isinstance(exc, OSError) else str(exc)
        raise StoreCorrupt("the %s failed (%s) and could not be fully undone yet; the next "
                           "tool call retries the rollback: %s" % (what, first, why)) from None
    undone = "nothing was changed"
    if not_back:
        undone = ("it was undone except for %d file(s) that could not be put back (%s; "
                  "see server.log)" % (len(not_back), ", ".join(map(repr, not_back[:5]))))
    if isinstance(exc, CheckpointError):
        raise CheckpointError("the %s failed and %s: %s" % (what, undone, exc)) from None
    if isinstance(exc, OSError):
        advice = OS_ERROR_ADVICE.get(exc.errno)
        raise CheckpointError("the %s failed and %s: %s%s"
                              % (what, undone, describe_os_error(exc),
                                 ". " + advice if advice else "")) from None
    raise exc


# ---------------------------------------------------------------------------
# 10. Store: location, lock, recovery, the active pointer and task states
# ---------------------------------------------------------------------------

# Put in every store: git then leaves the store out of `status`, `add -A`,
# `stash -u` (which would take it away from under a running server) and
# `clean -d`, wherever the store sits in a repository. Nothing of the user's
# repository is touched for it.
STORE_GITIGNORE = (b"# Written by task-checkpoint-mcp: git leaves this store alone.\n"
                   b"*\n")


def ignore_in_git(directory):
    """Write <directory>/.gitignore (everything ignored) unless one is there
    (ours, or one the user put there); an empty one, as a power cut can leave
    it, is written again. Best effort: tried at every write."""
    path = os.path.join(directory, ".gitignore")
    try:
        if os.lstat(path).st_size:
            return
    except FileNotFoundError:
        pass
    except OSError:
        return
    try:
        atomic_write(path, STORE_GITIGNORE, durable=False)
    except OSError:
        pass


def belongs_elsewhere_text(task_id, owner, root):
    """Why task_id, kept for the workspace owner, is not root's, and what
    to do."""
    if isinstance(owner, str) and not os.path.isdir(owner):
        return ("task %r belongs to the workspace %r, which is no longer there (moved?): "
                "tc_switch to it with root %r to continue it in this workspace"
                % (task_id, owner, root))
    return ("task %r belongs to the workspace %r, not %r; to continue it here, tc_export it "
            "there and tc_import the package here" % (task_id, owner, root))


def described_task(task_id, name):
    """ " (active task t-1: name)" for a message, or "" without a task."""
    if not task_id:
        return ""
    return " (active task %s: %s)" % (task_id, shown_path(name or ""))


def tasks_kept_for(store_dir, root):
    """The tasks in store_dir that may be root's, as (ids, the damaged
    among them), sorted: those whose state names root, the one the store
    has active for root, and any whose state does not read (its workspace
    is unknown)."""
    tasks = os.path.join(store_dir, "tasks")
    try:
        names = sorted(os.listdir(tasks))
    except OSError:
        return [], []
    kept, damaged = set(), []
    try:
        active = read_json(os.path.join(store_dir, "current.json"))["active"].get(root)
    except (OSError, StoreCorrupt, KeyError, TypeError, AttributeError):
        active = None
    for name in names:
        if not PLAIN_ID.match(name):
            continue
        try:
            state = read_json(os.path.join(tasks, name, "state.json"))
        except FileNotFoundError:  # an init that died midway: no task
            continue
        except (OSError, StoreCorrupt):
            damaged.append(name)
            continue
        if name == active or (isinstance(state, dict) and state.get("root") == root):
            kept.add(name)
    return sorted(kept.union(damaged)), damaged


# The temporary name an export builds its package under (see Checkpoints.export).
DEAD_EXPORT_NAME = re.compile(r"\A\.[^/\\]+-handoff\.tmp-[0-9a-f]+\Z")


def _export_note_target(note):
    """The package folder an export note names, or None when the note is not
    a small regular file holding one (a link, a FIFO, a folder, garbage)."""
    try:
        fh, st = open_regular(note)
        with fh:
            if st.st_size > 64 << 10:
                return None
            tmp = json.loads(fh.read_all(st.st_size).decode("utf-8")).get("tmp")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not (isinstance(tmp, str) and "\x00" not in tmp and os.path.isabs(tmp)
            and DEAD_EXPORT_NAME.match(os.path.basename(tmp))):
        return None
    try:
        os.fsencode(tmp)  # (a lone surrogate names no file)
    except UnicodeError:
        return None
    return tmp


def sweep_temp_files(directory):
    count = 0
    for dirpath, dirnames, filenames in os.walk(directory):
        if os.path.basename(dirpath) == "journal":
            dirnames[:] = []
            continue
        for name in filenames:
            if name.startswith(".tmp-"):
                count += remove_file(os.path.join(dirpath, name))
    return count


class Store:
    """One store directory: lock, payloads, per-task records, the active pointer."""

    def __init__(self, directory, log, *, lock_timeout=LOCK_TIMEOUT):
        self.directory = directory
        self.log = log
        self.payloads = PayloadStore(os.path.join(directory, "payload"))
        self.lock = StoreLock(os.path.join(directory, "state.lock"), on_acquire=self.recover,
                              on_release=self.end_write, timeout=lock_timeout)
        self._tasks = {}
        self._writing = False
        self._rollback_failures = {}  # journal folder -> error of its last rollback
        # What recover() rolled back since a result last said so (see
        # take_recovered): a call that only reads may be the one whose lock
        # finished a dead writer's restore, and its caller hears of it.
        self.recovered = collections.deque(maxlen=20)

    @property
    def refs_unchecked_path(self):
        return os.path.join(self.directory, "git", "unchecked.json")

    def refs_unchecked(self):
        """The tasks whose newest steps may lack their git refs: a writer
        died (found by any process, a hook's too) since each last saved.
        Kept in the store, so the next save of each, in whatever process,
        writes what is missing (see Saving._save_git)."""
        try:
            doc = read_json(self.refs_unchecked_path)
        except (FileNotFoundError, NotADirectoryError, StoreCorrupt):
            return set()
        tasks = doc.get("tasks") if isinstance(doc, dict) else None
        return {t for t in tasks if isinstance(t, str)} if isinstance(tasks, list) else set()

    def set_refs_unchecked(self, tasks):
        """Keep tasks as refs_unchecked (none: the file goes); best effort,
        a store that cannot be written only loses the catch-up."""
        try:
            if tasks:
                os.makedirs(os.path.dirname(self.refs_unchecked_path), exist_ok=True)
                write_json(self.refs_unchecked_path, {"tasks": sorted(tasks)})
            else:
                remove_file(self.refs_unchecked_path)
        except OSError as exc:
            self.log("could not note which git refs to check: %s" % describe_os_error(exc))

    def take_recovered(self):
        """The sentences of the rollbacks done since the last call, once."""
        said = []
        while self.recovered:
            try:
                said.append(self.recovered.popleft())
            except IndexError:
                break
        return said

    def task(self, task_id):
        records = self._tasks.get(task_id)
        if records is None:
            records = self._tasks[task_id] = TaskRecords(self.directory, task_id)
        return records

    def forget_caches(self):
        self._tasks.clear()
        self.payloads.forget_dirs()

    def task_states(self):
        """(task id, its state or None when it does not read) of every task."""
        out = []
        for task_id in self.task_ids():
            try:
                out.append((task_id, self.task(task_id).read_state()))
            except (CheckpointError, OSError):
                out.append((task_id, None))
        return out

    def task_ids(self):
        try:
            names = os.listdir(os.path.join(self.directory, "tasks"))
        except FileNotFoundError:
            return []
        return sorted(n for n in names if PLAIN_ID.match(n))

    @property
    def current_path(self):
        return os.path.join(self.directory, "current.json")

    def read_current(self):
        doc = read_json_or(self.current_path, None)
        if doc is None:
            return {}
        active = doc.get("active") if type(doc) is dict else None
        if type(active) is not dict or not all(
                type(k) is str and type(v) is str for k, v in active.items()):
            raise StoreCorrupt("store file %r (which task each workspace has active) is "
                               "damaged; delete it, then tc_switch to the task you want "
                               "(the task ids are the folders under %r)"
                               % (self.current_path, os.path.join(self.directory, "tasks")))
        return dict(active)

    def write_current(self, active):
        write_record(self.current_path, {"format": 1, "active": active})

    @property
    def budget_path(self):
        return os.path.join(self.directory, BUDGET_NAME)

    def budget_note(self):
        """What the budget passes found and reclaimed (see Compaction.keep_to_budget);
        {} when none ran, or the note cannot be read (it only reports)."""
        try:
            note = read_json_or(self.budget_path, {})
        except (OSError, StoreCorrupt):
            return {}
        return note if type(note) is dict else {}

    def named_content(self):
        """Every sha256 named anywhere in the task records or journals (a
        superset of the content still in use), or None when one of those
        files cannot be read."""
        named, failed = set(), []
        for top in ("tasks", "journal", KEPT_DIRNAME):
            top = os.path.join(self.directory, top)
            if not os.path.isdir(top):
                continue
            for dirpath, _dirnames, filenames in os.walk(top, onerror=failed.append):
                for name in filenames:
                    if name.startswith(".tmp-"):
                        continue
                    try:
                        with open_regular(os.path.join(dirpath, name))[0] as fh:
                            data = b"".join(fh.blocks())
                    except FileNotFoundError:
                        continue
                    except OSError:
                        return None
                    named.update(m.decode("ascii") for m in _NAMED_SHA.findall(data))
        return None if failed else named

    def rollback_blocker(self):
        """What kept a pending rollback from finishing at its last try, or None."""
        for directory in self.journal_dirs():
            failure = self._rollback_failures.get(directory)
            if failure:
                return failure
        return None

    def journal_dirs(self):
        base = os.path.join(self.directory, "journal")
        try:
            return [os.path.join(base, n) for n in sorted(os.listdir(base))]
        except FileNotFoundError:
            return []

    def clock_stamp(self, root):
        """The file system's clock now, read before a scan starts.

        A file whose mtime and ctime are older than this stamp cannot change
        without its stat changing. Read from a file touched in the store, so
        the stamp and the files' times come from the same clock; when the
        store is on another device, the wall clock minus a margin stands in.
        """
        path = os.path.join(self.directory, "clock")
        try:
            with open(path, "ab"):
                pass
            os.utime(path)
            st = os.stat(path)
            if st.st_dev == os.stat(root).st_dev:
                return st.st_mtime_ns
        except OSError:
            pass
        return time.time_ns() - RACY_MARGIN_NS

    @property
    def marker_path(self):
        return os.path.join(self.directory, "writing")

    def begin_write(self):
        """Mark the store as being written until the lock is released.

        A marker still present when the lock is next taken means the writer
        died: its temporary files are swept and its journal rolled back.
        """
        if not self._writing:
            with open(self.marker_path, "wb"):
                pass
            self._writing = True
            ignore_in_git(self.directory)

    def end_write(self):
        if self._writing:
            if self.payloads.suspect:
                # Left in place: the next lock holder checks recent payloads.
                self.log("a failed write left files it could not remove; they are "
                         "checked when the store is next locked")
                self.payloads.suspect = False
            else:
                remove_file(self.marker_path)
            self._writing = False

    @property
    def exports_path(self):
        return os.path.join(self.directory, "exporting")

    def begin_export(self, tmp):
        """Note where an export builds its package (one note per export, in
        exporting/): found at a later lock, a note whose package no process
        holds means the export died, and the package is removed. Returns the
        note, or None: a store that cannot be written still exports."""
        note = os.path.join(self.exports_path, os.path.basename(tmp) + ".json")
        try:
            if not os.path.isdir(self.exports_path) or os.path.islink(self.exports_path):
                if os.path.lexists(self.exports_path):  # not ours as it should be
                    remove_file(self.exports_path)
                os.makedirs(self.exports_path, exist_ok=True)
            with open(note, "w", encoding="utf-8") as fh:
                fh.write(json.dumps({"tmp": tmp}))
        except OSError:
            return None
        return note

    @staticmethod
    def end_export(note):
        if note is not None:
            try:
                remove_file(note)
            except OSError:  # a note left over only costs its check at a later lock
                pass

    def _clear_dead_exports(self):
        if os.path.islink(self.exports_path):
            return  # not the store's own folder: nothing in it is read (begin_export replaces it)
        try:
            names = os.listdir(self.exports_path)
        except OSError:
            return
        for name in names:
            note = os.path.join(self.exports_path, name)
            tmp = _export_note_target(note)
            if tmp is None or name != os.path.basename(tmp) + ".json":
                try:  # not a note this code wrote: it names nothing to remove
                    remove_file(note)
                except OSError:
                    pass
                continue
            try:
                abandoned = folder_abandoned(tmp)
                if abandoned is None:
                    continue  # cannot be told yet: the note stays for a later lock
                if abandoned:
                    remove_tree(tmp)
                    self.log("removed %r, the unfinished package of an export that was "
                             "stopped" % tmp)
            except Exception as exc:  # never a reason for the lock to fail
                self.log("the export note %r was dropped: %s" % (note, exc))
            self.end_export(note)

    def recover(self):
        """Clean up after a writer that died (called with the lock newly held).
        Content the dead writer (or a rollback cut short) left half written is
        removed first, so that a rollback never takes it for a stored copy."""
        self._clear_dead_exports()
        try:
            marked_ns = os.stat(self.marker_path).st_mtime_ns
        except FileNotFoundError:
            marked_ns = None
        if marked_ns is not None:
            swept = sweep_temp_files(self.directory)
            if swept:
                self.log("removed %d temporary file(s) left by an interrupted write" % swept)
            cut = self.payloads.verify_since(marked_ns - RACY_MARGIN_NS)
            if cut:
                self.log("removed %d stored content file(s) an interrupted write left "
                         "incomplete" % cut)
        journals = self.journal_dirs()
        for gone in set(self._rollback_failures) - set(journals):
            del self._rollback_failures[gone]  # rolled back by another process
        for directory in journals:
            # Every lock retries a rollback that failed; the log says so once
            # per journal and error, not at every watcher tick.
            failed_before = self._rollback_failures.get(directory)
            if failed_before is None:
                self.log("rolling back the interrupted operation %s"
                         % os.path.basename(directory))
            try:
                rollback = Rollback.of_journal(self, directory, keep_edits=True)
                if rollback is not None:
                    self._said_rolled_back(rollback, rollback.run())
            except Exception as exc:  # kept for the next try; writes refuse meanwhile
                if str(exc) != failed_before:
                    self.log("rollback of %s failed: %s" % (directory, exc))
                self._rollback_failures[directory] = str(exc)
            else:
                if self._rollback_failures.pop(directory, None) is not None:
                    self.log("rolled back %s after all" % os.path.basename(directory))
        if marked_ns is not None:
            tasks = set()
            for task_id in self.task_ids():
                if not self.task(task_id).exists():
                    # A task directory without a state is a tc_init that died
                    # midway (imports are journaled and were rolled back above).
                    remove_tree(self.task(task_id).directory)
                    continue
                self.reconcile_numbers(task_id)
                tasks.add(task_id)
            if tasks:  # the dead writer may have been a save cut off before its ref
                self.set_refs_unchecked(self.refs_unchecked() | tasks)
            remove_file(self.marker_path)

    def _said_rolled_back(self, rollback, not_back):
        """Log and keep for the next result what rolling back rollback did."""
        text = ("an interrupted %s (%s) was rolled back first: the %d file(s) it had begun "
                "to change in %r are as they were before it" % (
                    rollback.op, rollback.op_id or "no id", len(rollback.undo), rollback.root))
        if not_back:
            text += ", except %d that could not be put back (%s; see server.log)" % (
                len(not_back), ", ".join(map(repr, not_back[:5])))
        if rollback.edited:
            names = sorted(rollback.edited)
            text += ("; %d of them had been edited since (%s): what they held then is kept in "
                     "the store, listed in %s (file -> payload/<sha[:2]>/<sha>)" % (
                         len(names), ", ".join(map(repr, names[:5])) + (
                             ", ..." if len(names) > 5 else ""), rollback.kept.path))
        self.log(text)
        self.recovered.append(text)

    def reconcile_numbers(self, task_id):
        """Count records a dead writer left beyond its state, so no number is reused.

        A save cut off after its step (and the manifest and drift before it)
        landed but before the state file moved leaves complete records; they
        stay, and new records get numbers after them. A record beyond the
        state that does not parse (its bytes never reached the disk before a
        power cut; the state never pointed at it) is removed.
        """
        records = self.task(task_id)
        try:
            state = records.read_state()
        except (NotFound, StoreCorrupt):
            return
        changed = False
        for key, (numbers, path_of) in records.numbered_records().items():
            kept = [n for n in numbers if n <= state.get(key, 0) or self._whole(path_of(n))]
            if kept and kept[-1] > state.get(key, 0):
                state[key] = kept[-1]
                changed = True
        if changed:
            self.log("task %s: counted records left by an interrupted write" % task_id)
            records.write_state(state)

    def _whole(self, path):
        """True when a record left beyond its task's state parses; else it is removed."""
        try:
            if isinstance(read_json(path), dict):
                return True
        except StoreCorrupt:
            pass
        except OSError:
            return False
        self.log("removed %r, a record an interrupted write left incomplete" % path)
        remove_file(path)
        return False

    def make_active(self, root, task_id, previous):
        """Suspend root's active task `previous` and make task_id the active
        one; on failure the previous task is left as it was. The suspended id
        (None when nothing was open)."""
        suspended = self.suspend(previous) if previous != task_id else None
        try:
            active = self.read_current()
            if active.get(root) != task_id:
                active[root] = task_id
                self.write_current(active)
        except BaseException:
            if suspended:
                self.reopen(suspended)
            raise
        return suspended

    def reopen(self, task_id):
        """Best effort: put a task an unfinished switch suspended back to open."""
        try:
            records = self.task(task_id)
            state = records.read_state()
            state["status"] = "open"
            records.write_state(state)
        except (OSError, CheckpointError) as exc:
            self.log("task %s stays suspended after a failed switch: %s" % (task_id, exc))

    def suspend(self, task_id):
        if not task_id:
            return None
        records = self.task(task_id)
        try:
            state = records.read_state()
        except (NotFound, StoreCorrupt):
            return None
        if state.get("status") != "open":
            return None
        state["status"] = "suspended"
        records.write_state(state)
        return task_id

    def new_task_id(self, name):
        slug = slugify(name)
        while True:
            task_id = "%s-%s" % (slug, random_hex(3))
            if not self.task(task_id).exists():
                return task_id


class Workspace:
    """A validated root, its store, and (when resolved) a task."""

    def __init__(self, root, store, task_id=None, state=None):
        self.root = root
        self.store = store
        self.task_id = task_id
        self.state = state
        self.from_pointer = False  # the task is the root's active one, not a named one
        self.note = None  # what resolving it changed (a moved store followed it), for the result
        self._guard = False

    @property
    def guard(self):
        """kernel_path(root), found once: what the file checks compare with."""
        if self._guard is False:
            self._guard = kernel_path(self.root)
        return self._guard

    @property
    def records(self):
        return self.store.task(self.task_id)

    def policy_key(self):
        exclude = self.state.get("exclude", []) if self.state else []
        return (self.root, tuple(exclude), store_rel_in(self.root, self.store.directory))

    def load_state(self, lenient=False):
        try:
            self.state = self.records.read_state()
        except StoreCorrupt:
            if not lenient:
                raise
            self.state = None
            return self
        if self.state.get("root") != self.root:
            raise InvalidArgument(belongs_elsewhere_text(self.task_id, self.state.get("root"),
                                                         self.root))
        return self

    def follow_active(self, lenient=False):
        """Under the store lock, for a call that named no task: the active task
        is read again, so the call acts on the task active when it runs, not
        the one active when it arrived (another server may have switched
        meanwhile, and a save must never switch back)."""
        if not self.from_pointer:
            return
        active = self.store.read_current().get(self.root)
        if active is None:
            raise NotFound("no active task for %r: start one with tc_init, or continue a handoff "
                           "package with tc_import" % self.root)
        if active != self.task_id:
            self.task_id = active
            self.load_state(lenient)

    def need_writable(self):
        """Called inside the lock by every operation that writes the store."""
        if not self.store.lock.writable:
            refusal = self.store.lock.refusal
            if isinstance(refusal, OSError) and refusal.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreUnwritable("the store %r cannot be written: %s. %s"
                                      % (self.store.directory, describe_os_error(refusal),
                                         OS_ERROR_ADVICE[refusal.errno]))
            raise StoreUnwritable("the store %r cannot be written (read-only or missing "
                                  "permissions); free it or point TC_STORE elsewhere"
                                  % self.store.directory)
        if self.store.journal_dirs():
            raise StoreUnwritable("an interrupted restore or import in %r could not be rolled "
                                  "back yet: %s" % (self.store.directory, self.store.rollback_blocker()
                                                    or "see server.log; fix what blocks it (a "
                                                    "read-only or full disk) and retry"))
        try:
            self.store.begin_write()
        except OSError as exc:
            advice = OS_ERROR_ADVICE.get(exc.errno)
            raise StoreUnwritable("the store %r cannot be written (%s)%s"
                                  % (self.store.directory, describe_os_error(exc),
                                     ". " + advice if advice else "")) from None

    def activate(self):
        """Make self.task_id the active, open task of its root; True when the
        active task changed. (An active task found suspended, left so by an
        interrupted switch, is reopened too.)"""
        active = self.store.read_current()
        previous = active.get(self.root)
        state = self.records.read_state()
        if state["status"] == "suspended":
            state["status"] = "open"
            self.records.write_state(state)
        if previous == self.task_id:
            return False
        self.store.make_active(self.root, self.task_id, previous)
        return True


def slugify(name):
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40].strip("-")
    return slug or "task"


def checked_store_path(root, store, name):
    """The real path of store (named name in messages) as the store of the
    workspace root: absolute, neither root itself nor the filesystem root
    nor a folder holding root, and a new or empty folder or a store (a
    subdirectory of root is allowed)."""
    if isinstance(store, str) and "\x00" in store:
        raise InvalidArgument("%s %r must not contain a NUL character" % (name, store))
    if not isinstance(store, str) or not os.path.isabs(store):
        raise InvalidArgument("%s %r must be an absolute path" % (name, store))
    real = os.path.realpath(store)
    if real == root:
        raise InvalidArgument("%s %r is the workspace root itself; choose a directory "
                              "outside it or a subdirectory" % (name, store))
    if os.path.dirname(real) == real:
        raise InvalidArgument("%s %r is the filesystem root" % (name, store))
    if os.path.exists(real) and not os.path.isdir(real):
        raise InvalidArgument("%s %r exists and is not a directory" % (name, store))
    rel = store_rel_in(real, root)
    if rel is not None:
        raise InvalidArgument("%s %r contains the workspace; choose another directory"
                              % (name, store))
    if not store_or_empty(real):
        raise InvalidArgument("%s %r is a directory with other files in it; choose an "
                              "empty or new directory for the store" % (name, store))
    return real


class Workspaces:
    """Which store and task a call's root stands for: the stores in use
    (one Store object per directory, so its caches and lock serve every
    call), the store a workspace names, and resolving a root to a
    Workspace with its task."""

    def __init__(self, config, log, *, lock_timeout=LOCK_TIMEOUT):
        self.config = config
        self.log = log
        self.lock_timeout = lock_timeout  # how long a call waits for a store another holds
        self._stores = {}
        self._lock = threading.RLock()

    def store(self, directory):
        directory = os.path.realpath(directory)
        with self._lock:
            store = self._stores.get(directory)
            if store is None:
                store = self._stores[directory] = Store(
                    directory, functools.partial(self.log, store=directory),
                    lock_timeout=self.lock_timeout)
            return store

    def store_dir_for(self, root):
        """TC_STORE, else the workspace's own store (own_store_dir)."""
        if self.config.store:
            return checked_store_path(root, self.config.store, "TC_STORE")
        return self.own_store_dir(root)

    def own_store_dir(self, root):
        """The store the workspace names: its pointer file's, else <root>/.checkpoints."""
        pointer = os.path.join(root, POINTER_NAME)
        if os.path.isfile(pointer) and not os.path.islink(pointer):
            try:
                target = read_json(pointer).get("store")
            except (StoreCorrupt, OSError, AttributeError):
                target = None
            if isinstance(target, str) and os.path.isabs(target):
                return checked_store_path(root, target, "the store named by %r" % pointer)
            raise StoreCorrupt("the store pointer %r is damaged; fix or delete it" % pointer)
        return os.path.join(root, STORE_DIRNAME)

    def resolve(self, root, task_id=None, *, lenient=False, adopt=False):
        """Validate root and resolve the task (given by id or exact name, else
        the root's active one).

        lenient: a damaged state file leaves ws.state None instead of raising,
        so read-only reports can still describe the damage. adopt (tc_switch):
        a task whose workspace is no longer there becomes this root's. A
        store inside the workspace that moved with it follows it (see
        adopt_moved_tasks); ws.note then says so.
        """
        root = validate_root(root)
        store = self.store(self.store_dir_for(root))
        if store.journal_dirs():
            with store.lock:
                pass  # taking the lock rolls back what a dead process left half done
        note = self.adopt_moved_tasks(root, store)
        if task_id is not None:
            task_id = self.task_id_for(store, root, task_id)
            if adopt:
                note = self.adopt_task(root, store, task_id) or note
        ws = Workspace(root, store, task_id)
        ws.note = note
        ws.from_pointer = task_id is None
        if ws.task_id is None and os.path.isdir(store.directory):
            ws.task_id = store.read_current().get(root)
        if ws.task_id is None:
            raise self.no_active_task(root, store)
        return ws.load_state(lenient)

    @staticmethod
    def task_id_for(store, root, given):
        """The id of the task given names: its id, or the exact name of one
        task of this workspace. An unknown one is refused with the ids there are."""
        if not isinstance(given, str) or not given or "\x00" in given:
            raise InvalidArgument("task_id %r is not a task id" % (given,))
        if PLAIN_ID.match(given) and store.task(given).exists():
            return given
        states = store.task_states()
        named = [tid for tid, state in states if state and state.get("name") == given
                 and state.get("root") == root]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise InvalidArgument("%d tasks of this workspace are named %r (%s); pass one of "
                                  "their ids" % (len(named), given, ", ".join(named[:10])))
        if PLAIN_ID.match(given) and not states:
            raise NotFound("task %r does not exist in this store, which holds no task yet"
                           % given)
        mine = ["%s (%s)" % (tid, shown_path(state.get("name", "")))
                for tid, state in states if state and state.get("root") == root]
        listed = ", ".join(mine[:10]) if mine else "none"
        raise NotFound("task %r does not exist in this store; this workspace's tasks: %s "
                       "(pass an id, or a task's exact name)" % (given[:128], listed))

    def adopt_moved_tasks(self, root, store):
        """When the workspace's own store (root/.checkpoints, not one TC_STORE
        names) keeps no task for root and all its tasks are recorded for one
        other folder, which is gone or has a store of its own elsewhere, the
        store was moved or copied with the workspace (mv, cp -a): its tasks,
        and the active one, now belong to root. Not when that folder still
        uses this very store (its pointer names it, or it is this folder
        under another path, a bind mount). A note saying so, else None."""
        if self.config.store or (
                os.path.realpath(store.directory) != os.path.join(root, STORE_DIRNAME)):
            return None
        try:
            active = store.read_current() if os.path.isfile(store.current_path) else {}
        except StoreCorrupt:
            return None
        if root in active or not (active or store.task_ids()):
            return None
        states = store.task_states()
        old = {state.get("root") for _tid, state in states if state} | set(active)
        if len(old) != 1 or root in old or None in old:
            return None
        old = old.pop()
        if not isinstance(old, str) or self._uses_store(old, store):
            return None
        with store.lock:
            ws = Workspace(root, store)
            ws.need_writable()
            moved = []
            for task_id, state in store.task_states():
                if state and state.get("root") == old:
                    state["root"] = root
                    store.task(task_id).write_state(state)
                    moved.append(task_id)
            active = store.read_current()
            if old in active:
                active[root] = active.pop(old)
                store.write_current(active)
        note = ("the workspace was moved or copied from %r: its store came with it, and its "
                "tasks (%s) now belong to %r" % (old, ", ".join(moved[:10]), root))
        store.log(note)
        return note

    def _uses_store(self, folder, store):
        """Whether folder (still there) keeps its tasks in store."""
        if not os.path.isdir(folder):
            return False
        try:
            theirs = self.own_store_dir(folder)
        except CheckpointError:
            return True  # a damaged pointer there: not ours to take its tasks
        try:
            return os.path.samefile(theirs, store.directory)
        except OSError:
            return False

    @staticmethod
    def adopt_task(root, store, task_id):
        """tc_switch to a task whose workspace is no longer there: the task
        becomes root's. A note, or None when nothing changed (its workspace
        is there: load_state refuses it then)."""
        records = store.task(task_id)
        try:
            state = records.read_state()
        except (CheckpointError, OSError):
            return None
        owner = state.get("root")
        if owner == root or not isinstance(owner, str) or os.path.isdir(owner):
            return None
        if state.get("status") == "closed":
            raise TaskClosed("task %r is closed, and belongs to %r, which is no longer there; "
                             "a closed task is not changed: start a new task here with tc_init"
                             % (task_id, owner))
        with store.lock:
            Workspace(root, store).need_writable()
            state = records.read_state()
            if state.get("root") != owner:
                return None
            state["root"] = root
            records.write_state(state)
            active = store.read_current()
            if active.get(owner) == task_id:
                del active[owner]
                store.write_current(active)
        note = ("task %s belonged to %r, which is no longer there; it now belongs to %r"
                % (task_id, owner, root))
        store.log(note)
        return note

    def no_active_task(self, root, store):
        """The error for a workspace with no active task in store: what to do
        next. It names the enclosing workspace when root lies inside one;
        when root's own pointer names the store (a workspace moved or copied
        with an external store), the tasks the store keeps for other folders
        and how to continue them here; and, when TC_STORE chose the store
        while the workspace's own store holds its tasks, where those are
        (tc_init would refuse too)."""
        store_dir = store.directory
        enclosing = self.enclosing(root)
        if enclosing is not None:
            outer, task_id, name = enclosing
            return NotFound("no task for %r: it lies inside the workspace %r%s, whose store "
                            "records this folder too; pass root %r"
                            % (root, outer, described_task(task_id, name), outer))
        pointed = os.path.isfile(os.path.join(root, POINTER_NAME)) and not self.config.store
        if pointed and os.path.isdir(store_dir):
            # This workspace's own pointer names the store: it was moved or
            # copied from one of the folders the store keeps tasks for.
            others = [(tid, state) for tid, state in store.task_states()
                      if state and isinstance(state.get("root"), str)
                      and state["root"] != root and state.get("status") != "closed"]
            gone = [item for item in others if not os.path.isdir(item[1]["root"])]
            there = [item for item in others if os.path.isdir(item[1]["root"])]
            named = lambda items: ", ".join("%s (%s, for %r)" % (
                tid, shown_path(state.get("name", "")), state["root"]) for tid, state in items[:5])
            if gone:
                return NotFound("no active task for %r; the store %r that this workspace's "
                                "pointer names keeps tasks for a folder that is no longer "
                                "there: %s. If this folder is that one moved, tc_switch to the "
                                "task to continue it here; or start a new one with tc_init, or "
                                "continue a handoff package with tc_import"
                                % (root, store_dir, named(gone)))
            if there:
                return NotFound("no active task for %r; the store %r that this workspace's "
                                "pointer names keeps tasks of other folders: %s. To continue "
                                "one here, tc_export it there and tc_import the package here; "
                                "or start a new task with tc_init" % (root, store_dir,
                                                                     named(there)))
        plain = NotFound("no active task for %r: start one with tc_init, or continue a handoff "
                         "package with tc_import" % root)
        if not self.config.store:
            return plain
        try:
            own = self.own_store_dir(root)
        except CheckpointError:
            return plain
        kept = tasks_kept_for(own, root)[0] if own != store_dir else []
        if not kept:
            return plain
        return NotFound("no active task for %r in the store %r that TC_STORE names; the "
                        "workspace's tasks (%s) are in %r: unset TC_STORE, or set it to that "
                        "store, to reach them" % (root, store_dir, ", ".join(kept[:5]), own))

    def refuse_inside_another(self, root):
        """A new task (tc_init, tc_import) at a root inside another workspace
        would give that workspace's files a second store inside it: refused,
        naming the workspace, unless root already has a store of its own."""
        if (looks_like_store(os.path.join(root, STORE_DIRNAME))
                or os.path.isfile(os.path.join(root, POINTER_NAME))):
            return
        enclosing = self.enclosing(root)
        if enclosing is not None:
            outer, task_id, name = enclosing
            raise Conflict("%r lies inside the workspace %r%s, whose store records this folder "
                           "too: a task here would make a second store inside it. Pass root "
                           "%r to work there (tc_init or tc_switch there for another task), "
                           "or choose a folder outside it"
                           % (root, outer, described_task(task_id, name), outer))

    def enclosing(self, root):
        """(the workspace root lies inside, its active task id, that task's
        name) when a folder above root is a workspace with tasks, else None.
        A folder above counts when its own store (or the store its pointer
        names) keeps tasks for it, or when root's store keeps a task for it."""
        mine = self.store(self.store_dir_for(root))
        if os.path.isdir(mine.directory):
            for _tid, state in mine.task_states():
                owner = state.get("root") if state else None
                if (isinstance(owner, str) and _inside(root, owner)
                        and not self._leaves_out(state, owner, root)):
                    return self._described(mine, owner)
        current = os.path.dirname(root)
        while True:
            if (looks_like_store(os.path.join(current, STORE_DIRNAME))
                    or os.path.isfile(os.path.join(current, POINTER_NAME))):
                try:
                    store = self.store(self.own_store_dir(current))
                    kept = tasks_kept_for(store.directory, current)[0]
                    if kept and not any(self._leaves_out(store.task(tid).read_state(),
                                                         current, root) for tid in kept):
                        return self._described(store, current)
                except (CheckpointError, OSError):
                    pass
            parent = os.path.dirname(current)
            if parent == current:
                return None
            current = parent

    @staticmethod
    def _leaves_out(state, owner, root):
        """Whether the task (its state) of the workspace owner leaves out the
        folder root below it (a name rule or its exclude): then root's files
        are none of that workspace's."""
        rel = os.path.relpath(root, owner).replace(os.sep, "/")
        return PathPolicy(state.get("exclude") or ()).excluded_folder(rel)

    @staticmethod
    def _described(store, owner):
        """(owner, its active task id or None, that task's name or "")."""
        try:
            task_id = store.read_current().get(owner)
            name = store.task(task_id).read_state().get("name", "") if task_id else ""
        except (CheckpointError, OSError):
            task_id, name = None, ""
        return owner, task_id, name

    def release_caches(self, keep):
        """Drop what is cached for other stores and workspaces (parsed
        indexes, manifests) before an operation that needs memory of its
        own, so its peak is not stacked on top of theirs. They are read
        again when next needed."""
        with self._lock:
            for store in self._stores.values():
                if store is not keep:
                    store.forget_caches()


# ---------------------------------------------------------------------------
# 11. Watcher: a pure quiet-period decision plus a thread that applies it
# ---------------------------------------------------------------------------

def watch_decision(pending, now, signature, max_wait):
    """Decide what a watcher tick does.

    pending is None or (first_seen, last_signature); signature describes the
    unrecorded changes seen now (empty when there are none). Returns
    (action, new_pending) with action one of "idle", "wait", "capture",
    "partial": capture once the tree stopped changing for one tick; record a
    partial snapshot when it keeps changing for max_wait seconds.
    """
    if not signature:
        return "idle", None
    if pending is None:
        return "wait", (now, signature)
    first_seen, last_signature = pending
    if signature == last_signature:
        return "capture", None
    if now - first_seen >= max_wait:
        return "partial", (now, signature)
    return "wait", (first_seen, signature)


class FailureThrottle:
    """Log the 1st, 10th, 100th... consecutive failure of a key, and one recovery."""

    def __init__(self, log):
        self.log = log
        self.counts = {}

    def failed(self, key, message):
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        if count == 1 or (count >= 10 and str(count).strip("0") == "1"):
            self.log("watcher: %s failed (%d in a row): %s" % (key, count, message))

    def succeeded(self, key):
        if self.counts.pop(key, 0):
            self.log("watcher: %s recovered" % key)


# Linux inotify (<sys/inotify.h>).
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED = 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
IN_ISDIR = 0x40000000  # in an event: it is about a directory
WATCH_ADD_FLAGS = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO
                   | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
                   | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_EVENT_HEADER = struct.Struct("iIII")
# Local file systems whose changes inotify reports; any other root is polled.
EVENT_FILE_SYSTEMS = SYNCFS_FILE_SYSTEMS | {"overlay", "zfs"}
# A root whose directories reported nothing is still walked this often, for
# the changes the kernel does not report (a write through a hard link from
# outside the root, memory-mapped writes, another machine on a shared mount).
WATCH_FULL_SCAN_SECONDS = 30.0
# A root polled for a passing reason (too many directories, the kernel out
# of watches) tries watching again after this long.
WATCH_RETRY_SECONDS = 300.0
WATCH_PASSING_ERRORS = {errno.ENOSPC, errno.ENOMEM, errno.ENAMETOOLONG}
# A root with more directories than this, or than an eighth of the user's
# kernel budget of watches (which editors and other tools share), is polled
# rather than watched.
WATCH_DIRS_LIMIT = 8192
WATCH_BUDGET_SHARE = 8


def watch_dirs_limit():
    try:
        with open("/proc/sys/fs/inotify/max_user_watches", "rb") as fh:
            budget = int(fh.read().strip())
    except (OSError, ValueError):
        budget = 8192  # the kernel's old default
    return max(0, min(WATCH_DIRS_LIMIT, budget // WATCH_BUDGET_SHARE))


class _RootWatch:
    __slots__ = ("dirs", "ignored", "dirty", "scanned_at", "polling", "retry_at", "records",
                 "records_seen", "inode")

    def __init__(self, polling):
        self.dirs = {}           # rel -> (watch descriptor, inode of the directory watched)
        self.ignored = None      # (rel, name) -> True when a change there does not count
        self.dirty = True        # walk at the next tick
        self.scanned_at = None
        self.polling = polling   # walked every tick, no watches
        self.retry_at = None     # when polling for a passing reason, the time to watch again
        self.records = ()        # store files that say what is recorded (task, state, index)
        self.records_seen = None  # their stat before the last walk
        self.inode = None        # the root directory's inode at the last walk


def _stat_key(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class DirectoryEvents:
    """Which watched roots reported a change since their last walk (inotify).

    Only a hint that lets an idle tick skip its walk: a root is walked when
    a directory of it reported something, when the store files that say
    what is recorded for it changed (another task, a save, a restore, another
    server), while a change the watcher is waiting on settles, after a new
    directory gets its watch (for what happened before it), and every
    full_scan seconds regardless. Anything unexpected (no watch left, an
    error) puts the root on plain polling, as does a root on a file system
    outside EVENT_FILE_SYSTEMS or with more directories than
    watch_dirs_limit(); a passing reason is retried after
    WATCH_RETRY_SECONDS. The hint serves the watcher's idle ticks alone:
    tc_save, tc_capture and tc_resume always walk the whole workspace.
    """

    def __init__(self, fd, add, remove, *, full_scan=WATCH_FULL_SCAN_SECONDS, log=None):
        self.fd = fd
        self._add = add
        self._remove = remove
        self.full_scan = full_scan
        self.log = log or (lambda message: None)
        self.roots = {}   # root -> _RootWatch
        self.by_wd = {}   # watch descriptor -> {(root, rel)}
        self.dirs_limit = watch_dirs_limit()
        self.logged = set()  # (root, reason) already logged
        self._mounts = None  # /proc/self/mounts, which reports a change of the mount table
        try:
            import select
            fd = os.open("/proc/self/mounts", READ_FLAGS)
            self._mounts = (fd, select.poll())
            self._mounts[1].register(fd, select.POLLPRI | select.POLLERR)
            self._mounts_changed()
        except (ImportError, OSError, AttributeError):
            self._close_mounts()

    @classmethod
    def open(cls, **kwargs):
        """An instance, or None where inotify is not available."""
        if not sys.platform.startswith("linux"):
            return None
        try:
            import ctypes
            libc = c_library()
            init, add, remove = libc.inotify_init1, libc.inotify_add_watch, libc.inotify_rm_watch
            add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
            remove.argtypes = (ctypes.c_int, ctypes.c_int)
            fd = init(os.O_NONBLOCK | os.O_CLOEXEC)
        except (ImportError, OSError, AttributeError):
            return None
        if fd < 0:
            return None
        return cls(fd, add, remove, **kwargs)

    def close(self):
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        self._close_mounts()
        self.roots.clear()
        self.by_wd.clear()

    def _close_mounts(self):
        mounts, self._mounts = self._mounts, None
        if mounts is not None:
            os.close(mounts[0])

    def _refresh(self):
        """Take in what the kernel reported since the last call."""
        self._drain()
        if self._mounts_changed():
            self.keep_only(())

    def _mounts_changed(self):
        """True when the mount table changed since the last call (a mount over
        a watched folder hides it from its watch: every root starts over)."""
        if self._mounts is None:
            return False
        fd, poller = self._mounts
        if not poller.poll(0):
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        while os.read(fd, 65536):  # reading it to the end re-arms the report
            pass
        return True

    def needs_walk(self, root, now):
        """True when root has to be walked at this tick."""
        self._refresh()
        watch = self.roots.get(root)
        if watch is None or watch.polling or watch.dirty or self.fd is None:
            return True
        if now - watch.scanned_at >= self.full_scan:
            return True
        try:
            if os.stat(root).st_ino != watch.inode:  # the root, or a folder above it, replaced
                return True
        except OSError:
            return True
        return [_stat_key(path) for path in watch.records] != watch.records_seen

    def walking(self, root, now):
        """root is about to be walked: what is reported from here on counts for
        the next tick."""
        self._refresh()
        watch = self.roots.get(root)
        if watch is None:
            watch = self.roots[root] = _RootWatch(
                not file_system_types_under(root) <= EVENT_FILE_SYSTEMS)
        watch.dirty = False
        watch.scanned_at = now
        watch.records_seen = [_stat_key(path) for path in watch.records]

    def walked(self, root, dirs, ignored, records):
        """After a walk of root that went through dirs [(rel, inode)]: watch the
        new ones (and a directory that replaced a watched one), drop the gone
        ones. records: the store files read for the walk."""
        watch = self.roots.get(root)
        if watch is None or self.fd is None:
            return
        if watch.polling:
            if watch.retry_at is None or watch.scanned_at < watch.retry_at:
                return
            watch.polling, watch.retry_at = False, None  # the reason may have passed
        watch.ignored = ignored
        records = tuple(records)
        if records != watch.records:  # another task: look again with its files
            watch.records = records
            watch.dirty = True
        if not dirs or dirs[0][0] != "":  # the root was not walked (task closed, unreadable)
            watch.dirty = True
        else:
            watch.inode = dirs[0][1]
        if len(dirs) > self.dirs_limit:
            self._poll(root, "it has more than %d directories" % self.dirs_limit, retry=True)
            return
        wanted = dict(dirs)
        for rel, (_wd, inode) in list(watch.dirs.items()):
            if wanted.get(rel) != inode:
                self._unwatch(root, watch, rel)
        for rel, inode in dirs:
            if rel in watch.dirs:
                continue
            wd = self._add(self.fd, os.fsencode(os.path.join(root, rel) if rel else root),
                           WATCH_ADD_FLAGS)
            if wd < 0:
                import ctypes
                code = ctypes.get_errno()
                if code in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP):
                    watch.dirty = True  # gone or changed since the walk: walk again
                    continue
                self._poll(root, os.strerror(code), retry=code in WATCH_PASSING_ERRORS)
                return
            watch.dirs[rel] = (wd, inode)
            self.by_wd.setdefault(wd, set()).add((root, rel))
            watch.dirty = True  # what changed in it before the watch existed

    def mark(self, root):
        """Walk root at the next tick (its last walk failed)."""
        watch = self.roots.get(root)
        if watch is not None:
            watch.dirty = True

    def keep_only(self, roots):
        for root in [root for root in self.roots if root not in roots]:
            watch = self.roots.pop(root)
            for rel in list(watch.dirs):
                self._unwatch(root, watch, rel)

    def _poll(self, root, reason, retry=False):
        watch = self.roots[root]
        for rel in list(watch.dirs):
            self._unwatch(root, watch, rel)
        watch.polling = watch.dirty = True
        if retry and watch.scanned_at is not None:
            watch.retry_at = watch.scanned_at + WATCH_RETRY_SECONDS
        if (root, reason) not in self.logged:
            self.logged.add((root, reason))
            self.log("watcher: polling %s (no change events: %s)" % (root, reason))

    def _unwatch(self, root, watch, rel):
        wd = watch.dirs.pop(rel)[0]
        users = self.by_wd.get(wd)
        if users is not None:
            users.discard((root, rel))
            if not users:
                del self.by_wd[wd]
                if self.fd is not None:
                    self._remove(self.fd, wd)

    def _drain(self):
        while self.fd is not None:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError as exc:  # the descriptor is unusable: poll from now on
                for root in list(self.roots):
                    if not self.roots[root].polling:
                        self._poll(root, describe_os_error(exc))
                fd, self.fd = self.fd, None
                try:
                    os.close(fd)
                except OSError:
                    pass
                return
            if not data:
                return
            offset = 0
            while offset + _EVENT_HEADER.size <= len(data):
                wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(data, offset)
                offset += _EVENT_HEADER.size
                name = data[offset:offset + length].rstrip(b"\0")
                offset += length
                self._event(wd, mask, name)

    def _event(self, wd, mask, name):
        if mask & IN_Q_OVERFLOW or wd < 0:  # events were lost: walk everything
            for watch in self.roots.values():
                watch.dirty = True
            return
        users = self.by_wd.get(wd)
        if not users:
            return
        if mask & IN_IGNORED:  # the directory is gone (or its watch removed)
            del self.by_wd[wd]
            for root, rel in users:
                watch = self.roots.get(root)
                if watch is not None:
                    if watch.dirs.get(rel, (None,))[0] == wd:
                        del watch.dirs[rel]
                    watch.dirty = True
            return
        text = os.fsdecode(name)
        for root, rel in users:
            watch = self.roots.get(root)
            if watch is None or watch.dirty:
                continue
            if text and watch.ignored is not None and watch.ignored(
                    rel + "/" + text if rel else text, text, bool(mask & IN_ISDIR)):
                continue
            watch.dirty = True


class Watcher:
    """Background thread: every interval, check each watched root once.

    It depends on three calls only: roots() lists the roots to watch,
    signature(root, walked) describes a root's unrecorded changes (empty
    when there are none; walked as in Saving.unrecorded_signature), and
    capture(root, partial) records them. Where the kernel reports directory
    changes (DirectoryEvents), a root that reported none since its last
    check is not walked again."""

    def __init__(self, *, roots, signature, capture, interval, max_wait, log, events=True,
                 full_scan=WATCH_FULL_SCAN_SECONDS):
        self.roots = roots
        self.signature = signature
        self.capture = capture
        self.interval = interval
        self.max_wait = max_wait
        self.throttle = FailureThrottle(log)
        self.pending = {}
        self.events = DirectoryEvents.open(full_scan=full_scan, log=log) if events else None
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tc-watcher", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self, timeout=5.0):
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.events is not None and not self.thread.is_alive():
            self.events.close()

    def _run(self):
        try:
            while not self.stop_event.wait(self.interval):
                roots = self.roots()
                if self.events is not None:
                    self.events.keep_only(roots)
                for root in roots:
                    if self.stop_event.is_set():
                        return
                    self.tick(root)
        finally:
            if self.events is not None and self.stop_event.is_set():
                self.events.close()  # a stop() that gave up waiting leaves this to the thread

    def tick(self, root, now=None):
        """One check of root. A failed capture keeps the pending change, so the
        next tick retries it and a lasting fault counts as one run of failures."""
        now = time.monotonic() if now is None else now
        previous = self.pending.get(root)
        events = self.events
        try:
            walked = None
            if events is not None:
                if previous is None and not events.needs_walk(root, now):
                    return "idle"
                events.walking(root, now)
                walked = {}
            signature = self.signature(root, walked)
            if walked is not None:
                events.walked(root, walked.get("dirs", ()), walked.get("ignored"),
                              walked.get("records", ()))
            action, pending = watch_decision(previous, now, signature, self.max_wait)
            if action in ("capture", "partial"):
                self.pending[root] = (previous[0], signature)
                self.capture(root, action == "partial")
            self.pending[root] = pending
            if action != "wait":
                self.throttle.succeeded(root)
            return action
        except Exception as exc:  # a tick must never kill the thread
            if events is not None:
                events.mark(root)
            self.throttle.failed(root, "%s: %s" % (exc.__class__.__name__, exc))
            return "error"

    def is_waiting(self, root):
        return self.pending.get(root) is not None

    def reset(self, root):
        self.pending.pop(root, None)


# ---------------------------------------------------------------------------
# 12. Git: every new step as refs/checkpoints/<task_id>/sNNNN
# ---------------------------------------------------------------------------

GIT_REF_PREFIX = "refs/checkpoints/"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "task-checkpoint",
    "GIT_AUTHOR_EMAIL": "task-checkpoint@localhost",
    "GIT_COMMITTER_NAME": "task-checkpoint",
    "GIT_COMMITTER_EMAIL": "task-checkpoint@localhost",
}
# Variables of the user's (or a calling hook's) environment that are kept;
# every other GIT_* variable is dropped before git runs.
GIT_ENV_KEPT = frozenset({
    "GIT_EXEC_PATH", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM",
    "GIT_CONFIG_NOSYSTEM", "GIT_SSL_CAINFO",
})
# Configuration forced on every call: no hook may run (update-ref would run
# a reference-transaction hook), our temporary index must never leave shared
# split-index files in the user's .git, and no commit gets signed.
GIT_FORCED_CONFIG = ("core.splitIndex=false", "core.untrackedCache=false",
                     "commit.gpgSign=false")
# A save with at least this many files new to git hashes them in parallel.
SPLIT_HASHING = 256

# Git processes that hash a first save's files side by side.
GIT_HASH_PROCESSES = max(1, min(4, os.cpu_count() or 1))

_REF_COMPONENT = re.compile(r"^(?!\.)(?!.*\.\.)(?!.*\.lock$)(?!.*\.$)[A-Za-z0-9._-]+\Z")

# A git process that runs this long is stopped (a hung network mount under
# .git, say): the save stands, without its ref, instead of waiting forever.
GIT_TIMEOUT = 300


class GitCommandFailed(Exception):
    """A git process could not run or exited non-zero; the text says which and why."""

    def __init__(self, message, *, missing=False, stderr=b""):
        super().__init__(message)
        self.missing = missing
        self.stderr = stderr


def git_environment(base=None):
    """The environment every git process of ours gets.

    The repository is always the one that contains the workspace `root`,
    found by git's own discovery from `root`: GIT_DIR, GIT_WORK_TREE,
    GIT_INDEX_FILE, GIT_OBJECT_DIRECTORY, GIT_CEILING_DIRECTORIES and every
    other GIT_* variable set for the server are deliberately ignored (they
    are often left behind by a hook or a wrapper and would redirect writes
    into another repository or into the user's index). The user's
    configuration files stay readable. GIT_OPTIONAL_LOCKS=0 keeps git
    from refreshing the user's index file as a side effect, LC_ALL=C keeps
    the output parseable, and the fixed identity means no user.name is needed.
    """
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items()
           if not k.startswith("GIT_") or k in GIT_ENV_KEPT}
    env.update(GIT_IDENTITY)
    env.update({"LC_ALL": "C", "LANGUAGE": "C", "GIT_OPTIONAL_LOCKS": "0",
                "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "PAGER": "cat"})
    return env


def find_git_marker(root):
    """True when `root` or one of its parents holds a `.git` directory or file.

    A cheap pre-check so that a workspace outside any repository never
    starts a git process; git itself has the final word.
    """
    return find_upwards(os.path.abspath(root),
                        lambda directory: os.path.lexists(os.path.join(directory, ".git"))) is not None


def step_ref_name(task_id, step_index):
    """refs/checkpoints/<task_id>/s0001 (four digits, more when needed)."""
    return "%s%s/s%04d" % (GIT_REF_PREFIX, task_id, step_index)


def git_file_mode(mode):
    """The git tree mode for a recorded st_mode: executable by owner or not."""
    return "100755" if mode & 0o100 else "100644"


class GitObjectCache:
    """The git objects of one task's last checkpoint commit.

    Two files under <store>/git/tasks/: <task_id>.json {"version", "repo":
    git common dir, "commit", "trees": [tree ids], "blobs_gen"} and
    <task_id>.blobs.json {"gen", "blobs": {sha256 of stored content: blob
    id}}, the second rewritten only when the blobs change. The ids are
    trusted only while that commit is still the target of one of the
    task's checkpoint refs (the ref keeps every object under it from being
    pruned, so a tree may name them without asking git whether they exist)
    and both files carry the same generation (a crash between the two
    writes costs hashing again, never a wrong id). Parsed files are kept in
    memory while their stat is unchanged. Written with temp + os.replace,
    not flushed: losing them only costs hashing again.
    """

    VERSION = 3
    _parsed = {}  # path -> (stat key, document); the last two only
    _parsed_lock = threading.Lock()

    def __init__(self, store_git, repo_key, task_id):
        directory = os.path.join(store_git, "tasks")
        self.head_path = os.path.join(directory, task_id + ".json")
        self.blobs_path = os.path.join(directory, task_id + ".blobs.json")
        self.repo_key = repo_key
        self.head = self._load(self.head_path)
        self.blobs_doc = None

    @classmethod
    def _load(cls, path):
        try:
            st = os.stat(path)
        except OSError:
            return {}
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with cls._parsed_lock:
            hit = cls._parsed.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            with open(path, "r", encoding="utf-8") as fh:
                doc = parse_json(fh.read())
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict):
            return {}
        cls._remember_parsed(path, key, doc)
        return doc

    @classmethod
    def _remember_parsed(cls, path, key, doc):
        with cls._parsed_lock:
            cls._parsed.pop(path, None)
            cls._parsed[path] = (key, doc)
            while len(cls._parsed) > 2:  # one task's pair: a blobs map can be megabytes
                cls._parsed.pop(next(iter(cls._parsed)))

    def trusted(self, commits):
        """({sha256: blob id}, {tree id}) of the task's last commit, if that
        commit is one of `commits` (the task's refs); else two empty sets."""
        head = self.head
        if (head.get("version") != self.VERSION or head.get("repo") != self.repo_key
                or head.get("commit") not in commits):
            return {}, set()
        doc = self._load(self.blobs_path)
        blobs, trees = doc.get("blobs"), head.get("trees")
        if (doc.get("gen") != head.get("blobs_gen") or not isinstance(blobs, dict)
                or not isinstance(trees, list)):
            return {}, set()
        self.blobs_doc = doc
        return blobs, set(trees)

    def remember(self, commit, blobs, trees):
        """Record the commit just made (its ref exists) and the objects under it."""
        gen = self.blobs_doc.get("gen") if self.blobs_doc else None
        if self.blobs_doc is None or self.blobs_doc.get("blobs") != blobs:
            gen = random_hex(8)
            self._write(self.blobs_path, {"gen": gen, "blobs": blobs})
            with contextlib.suppress(OSError):  # the single cache file of earlier versions
                remove_file(os.path.join(os.path.dirname(os.path.dirname(self.blobs_path)),
                                         "blobs.json"))
        self._write(self.head_path, {"version": self.VERSION, "repo": self.repo_key,
                                     "commit": commit, "trees": sorted(trees),
                                     "blobs_gen": gen})

    def _write(self, path, doc):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps(doc, separators=(",", ":")).encode("utf-8"),
                     durable=False)
        try:
            st = os.stat(path)
        except OSError:
            return
        self._remember_parsed(path, (st.st_mtime_ns, st.st_size, st.st_ino), doc)


def git_trees(files, oid_bytes):
    """The tree objects git would make for (path, mode, blob id) rows.

    Returns [(tree id, [(mode, type, id, name bytes)])], every subtree
    before the tree that holds it, the root tree last. Entries are in git's
    order (a directory sorts as if its name ended in "/"); the id is the
    object hash of the encoded tree, SHA-1 or SHA-256 by `oid_bytes`.
    """
    algo = hashlib.sha256 if oid_bytes == 32 else hashlib.sha1
    dirs = {"": {}}
    for path, mode, oid in files:
        parent, _, name = path.rpartition("/")
        if parent not in dirs:
            dirs[parent] = {}
            child = parent
            while child:  # register the new directory in each missing parent
                grand, _, sub = child.rpartition("/")
                known = grand in dirs
                dirs.setdefault(grand, {})[sub] = None  # a subtree, built below
                if known:
                    break
                child = grand
        dirs[parent][name] = (mode, "blob", oid)
    ids = {}
    out = []
    for directory in sorted(dirs, key=lambda d: d.count("/") + (d != ""), reverse=True):
        prefix = directory + "/" if directory else ""
        rows = []
        for name, entry in dirs[directory].items():
            raw = name.encode("utf-8", "surrogateescape")
            if entry is None:
                rows.append((raw + b"/", raw, ("040000", "tree", ids[prefix + name])))
            else:
                rows.append((raw, raw, entry))
        rows.sort(key=lambda row: row[0])
        body = b"".join(b"%s %s\0" % (mode.lstrip("0").encode(), raw) + bytes.fromhex(oid)
                        for _, raw, (mode, _, oid) in rows)
        ids[directory] = algo(b"tree %d\0" % len(body) + body).hexdigest()
        out.append((ids[directory], [(mode, kind, oid, raw)
                                     for _, raw, (mode, kind, oid) in rows]))
    return out


class GitRefWriter:
    """Writes each new step as a commit under refs/checkpoints/<task_id>/sNNNN.

    Contract:
    - Plumbing only: one rev-parse (git dir, common dir, work tree top),
      hash-object (only for content git does not have yet; GIT_HASH_PROCESSES
      side by side from SPLIT_HASHING files on), hash-object -t tree (only
      for trees git does not have yet), commit-tree, update-ref: at most
      five processes for a save in a repository whose refs are files (one
      more rev-parse when update-ref fails, to tell an existing ref from
      another failure; a save after a dead writer that also writes the
      missing ref of the step before its own pays the same once more).
      The tree ids are computed here (git_trees),
      so only the directories that changed since the last checkpoint are
      sent to git, and git's answer must match them.
      Nothing moves HEAD, touches a branch, the user's index or the work
      tree: no index is used at all, and the blobs come from the payload
      store, not from the work tree.
    - With verify on, the repository is fingerprinted before and after
      the ref is made: HEAD of the worktree's git dir, a sha256 of the
      user's index file, every ref outside refs/checkpoints/ as parsed
      {name: value} (packed-refs overlaid by loose files, so `git
      pack-refs` is no change), and a sha256 of the stash reflog. These
      are read as files, with no process; the work tree is not compared,
      since nothing here writes to it. The task's existing checkpoint refs
      are read from the same files. A repository whose refs are not files
      (reftable) is read through git instead: worktree list, ls-files,
      for-each-ref and stash list twice, and for-each-ref for the task's
      refs: 14 processes for a save that makes a ref, 6 with verify off.
    - The commit's tree root is the workspace directory. For a workspace
      that is a subdirectory of a larger repository the tree therefore
      holds paths relative to the workspace, not to the repository top
      (compare with `git diff HEAD:<subdir> refs/checkpoints/...`).
    - The tree holds the manifest's stored files ("f"); sensitive ("s")
      and content-less large files ("b") never reach git. The caller
      passes no path inside the store.
    - The parent is the task's previous checkpoint commit (the ref named
      by `parent_hint` when it exists, else the highest-numbered step ref
      below this one), so `git log` walks the task's steps. The first
      step's commit has none, so a repository without any commit needs
      nothing more; a workspace whose `.git` is a file (a linked worktree,
      a submodule) is found by rev-parse like any other.
    - The ref is created with `update-ref <ref> <new> <zero-oid>`: git
      refuses to overwrite an existing ref, so there is no
      check-then-write race; an existing ref yields reason "ref exists".
    - The number of git processes is constant per save, whatever the
      number of files; content already in the task's last checkpoint
      commit is never hashed again.
    - It never raises: every failure becomes {"ok": False, "error": ...}
      and a line in the log.
    """

    def __init__(self, *, enabled, verify, log, environ=None):
        self.enabled = bool(enabled)
        self.verify = bool(verify)
        self.log = log
        self.environ = environ  # the server's environment; None: os.environ

    @staticmethod
    def skipped(reason, *, ref=None, error=None, unchanged=None, ok=False):
        """The git result of a save that made no ref, for `reason`; ok when
        there was nothing to do (outside a repository)."""
        result = {"ok": ok, "ref": ref, "reason": reason, "unchanged": unchanged}
        if error is not None:
            result["error"] = error
        return result

    @staticmethod
    def made(ref, *, unchanged=None):
        """The git result of a save that created `ref`."""
        return {"ok": True, "ref": ref, "reason": None, "unchanged": unchanged}

    def write_step_ref(self, *, root, store_dir, task_id, step_index,
                       entries, payload_path, message, parent_hint=None, earlier=None):
        """Create refs/checkpoints/<task_id>/sNNNN for a new step; never raises.
        earlier: (number, load) of steps before it, oldest first, whose refs
        are written first where they have none; load() returns that step's
        (entries, message)."""
        if not self.enabled:
            return self.skipped("TC_GIT=off")
        try:
            if not find_git_marker(root):
                return self.skipped("not a git repo", ok=True)
            run = _GitRunner(root, store_dir, git_environment(self.environ))
            return self._write_verified(run, store_dir, task_id, step_index,
                                        entries, payload_path, message, parent_hint, earlier)
        except GitCommandFailed as exc:
            return self._failure(exc, task_id, step_index)
        except Exception as exc:  # a bug or an OS error must not fail the save
            return self._failure(GitCommandFailed("%s: %s" % (type(exc).__name__, exc)),
                                 task_id, step_index)

    def _failure(self, exc, task_id, step_index):
        reason = "git not found" if exc.missing else "git failed"
        self.log("git ref for %s step %d not written: %s" % (task_id, step_index, exc))
        return self.skipped(reason, error=str(exc))

    def _write_verified(self, run, store_dir, task_id, step_index,
                        entries, payload_path, message, parent_hint, earlier):
        repo_key = run.discover()
        if repo_key is None:
            # A .git was found but git does not accept it (damaged or foreign).
            self.log("no git repository for %r: %s" % (run.root, run.not_a_repo))
            return self.skipped("not a git repo", error=run.not_a_repo)
        before = run.fingerprint() if self.verify else None
        try:
            result = self._create_ref(run, repo_key, store_dir, task_id, step_index,
                                      entries, payload_path, message, parent_hint, earlier)
        except GitCommandFailed as exc:
            result = self._failure(exc, task_id, step_index)
        if before is not None:
            result["unchanged"] = self._unchanged(run, before, task_id)
        return result

    def _unchanged(self, run, before, task_id):
        try:
            after = run.fingerprint()
        except GitCommandFailed as exc:
            self.log("git fingerprint after saving %s failed: %s" % (task_id, exc))
            return None
        if after != before:
            self.log("git repository changed while saving %s" % task_id)
        return after == before

    def _create_ref(self, run, repo_key, store_dir, task_id, step_index,
                    entries, payload_path, message, parent_hint, earlier=None):
        if not _REF_COMPONENT.match(task_id or ""):
            raise GitCommandFailed("task id %r is not a valid git ref component" % task_id)
        ref = step_ref_name(task_id, step_index)
        existing = run.task_refs(task_id)
        if ref in existing:
            self.log("git ref %s already exists; left as it is" % ref)
            return self.skipped("ref exists")
        caches = os.path.join(store_dir, "git")
        for number, load in earlier or ():
            if 1 <= number < step_index:
                self._catch_up(run, (caches, repo_key, task_id), existing, (number, load),
                               payload_path)
        parent = choose_parent(existing, ref, parent_hint)
        if not self._make_ref(run, (caches, repo_key, task_id), existing, ref, entries,
                              payload_path, parent, message):
            self.log("git ref %s appeared concurrently; left as it is" % ref)
            return self.skipped("ref exists")
        return self.made(ref)

    def _make_ref(self, run, cache_key, existing, ref, entries, payload_path, parent, message):
        """Commit the stored files of entries and point the new ref at it;
        False when the ref appeared meanwhile. existing gets the new ref."""
        files = [(path, git_file_mode(entry.mode), entry.sha) for path, entry in entries.items()
                 if entry.kind == KIND_FILE]
        cache = GitObjectCache(*cache_key)
        commit, blobs, trees = self._commit(run, cache, files, payload_path, parent, message,
                                            set(existing.values()))
        if not run.create_ref(ref, commit, message):
            return False
        cache.remember(commit, blobs, trees)  # only a commit a ref holds is trusted later
        existing[ref] = commit
        return True

    def _catch_up(self, run, cache_key, existing, earlier, payload_path):
        """Write the ref of a step before a new one when it has none (after
        a writer died: see Saving._save_git). A failure here is logged and
        costs the new step nothing."""
        number, load = earlier
        ref = step_ref_name(cache_key[2], number)
        if ref in existing:
            return
        try:
            entries, message = load()
            if self._make_ref(run, cache_key, existing, ref, entries, payload_path,
                              choose_parent(existing, ref, None), message):
                self.log("git ref %s was missing after a writer died; written now" % ref)
        except (CheckpointError, OSError, GitCommandFailed) as exc:
            self.log("git ref %s is missing and was not written: %s" % (ref, exc))

    def _commit(self, run, cache, files, payload_path, parent, message, commits):
        """Hash the content git is not known to have, write the trees it
        does not have, and commit. Every object a new tree names is either
        written by this save or under the task's last commit, which a ref
        still holds; so mktree need not look each entry up."""
        blobs, have_trees = cache.trusted(commits)
        missing = sorted({sha for _, _, sha in files if sha not in blobs})
        if missing:
            blobs = dict(blobs)
            oids = run.hash_blobs([payload_path(sha) for sha in missing])
            blobs.update(zip(missing, oids))
        trees = git_trees([(path, mode, blobs[sha]) for path, mode, sha in files],
                          run.oid_bytes)
        new = {}
        for tree_id, rows in trees:
            if tree_id not in have_trees and tree_id not in new:
                new[tree_id] = rows
        if new:
            run.make_trees(list(new.items()))
        commit = run.commit_tree(trees[-1][0], parent, message)
        return (commit, {sha: blobs[sha] for _, _, sha in files},
                [tree_id for tree_id, _ in trees])


def step_message(task_id, index, title):
    """The commit message of a step's checkpoint commit."""
    return "checkpoint %s s%04d: %s" % (task_id, index, title)


def choose_parent(existing, ref, parent_hint):
    """The parent commit: `parent_hint` if it is an existing ref of the task,
    else the highest-numbered step ref below `ref`, else None."""
    if parent_hint and parent_hint in existing and parent_hint != ref:
        return existing[parent_hint]
    below = [name for name in existing if _step_key(name) < _step_key(ref)]
    return existing[max(below, key=_step_key)] if below else None


def stderr_summary(stderr):
    """The lines of git's stderr that say what failed (fatal:/error:), joined."""
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    wanted = [l.strip() for l in lines if l.startswith(("fatal:", "error:"))]
    return " / ".join((wanted or lines)[:3]) or "no message"


def git_message_text(message):
    """message as git takes it in a commit or on a command line: a NUL
    (which git refuses, and no argument can hold) is written as \\0."""
    return (message or "").replace("\0", "\\0")


def reflog_message(message):
    """One line for the reflog (update-ref refuses line breaks)."""
    first = git_message_text(message).strip().splitlines()[:1]
    return "checkpoint: " + (first[0][:200] if first else "step")


def _step_key(ref):
    tail = ref.rsplit("/", 1)[-1]
    return int(tail[1:]) if tail[:1] == "s" and tail[1:].isdigit() else -1


_OBJECT_ID = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")


def file_digest(path):
    """sha256 hex of a regular file's bytes; None when it is missing, cannot
    be read, or is not a regular file."""
    digest = hashlib.sha256()
    try:
        fh, _st = open_regular(path, follow=True)
        with fh:
            for block in fh.blocks():
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def index_digest(path, oid_bytes):
    """sha256 of what a git index says about its entries: mode, object id,
    stage and path of each, in order, leaving out the cached stat data that
    any `git status` may refresh. Versions 2 to 4 of the format; anything
    else (or a damaged file) is hashed whole. None when it cannot be read."""
    data = read_file_or_none(path)
    if data is None:
        return None
    try:
        return _index_entries_digest(data, oid_bytes)
    except (ValueError, IndexError, struct.error):
        return "raw:" + hashlib.sha256(data).hexdigest()


def _index_entries_digest(data, oid_bytes):
    digest = hashlib.sha256(b"%d\0" % struct.unpack_from(">I", data, 8)[0])
    for mode, oid, stage, path in index_entries(data, oid_bytes):
        digest.update(mode + oid + bytes((stage,)) + path + b"\0")
    return digest.hexdigest()


def loose_refs(git_dir, under, exclude=None):
    """{ref name: stripped content} of the loose ref files below
    <git_dir>/<under> ("refs" or a deeper prefix), leaving out the
    directory `exclude` (a ref prefix such as "refs/checkpoints/") and
    lock files. An unreadable file has the value None; a missing or
    unreadable directory contributes nothing.
    """
    base = os.path.join(git_dir, *under.split("/"))
    skip = os.path.join(git_dir, *exclude.strip("/").split("/")) if exclude else None
    refs = {}
    for dirpath, dirnames, filenames in os.walk(base):
        if skip is not None:
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) != skip]
        for name in filenames:
            if name.endswith(".lock"):
                continue
            full = os.path.join(dirpath, name)
            data = read_file_or_none(full)
            ref = os.path.relpath(full, git_dir).replace(os.sep, "/")
            refs[ref] = None if data is None else data.strip().decode("utf-8", "surrogateescape")
    return refs


def packed_refs(common_dir, within=None, exclude=None):
    """{ref name: object id} from <common_dir>/packed-refs ({} when absent):
    only names starting with `within` when given, none starting with
    `exclude`. The header comment and the `^<peeled>` lines are skipped."""
    data = read_file_or_none(os.path.join(common_dir, "packed-refs"))
    text = (data or b"").decode("utf-8", "surrogateescape")
    if within is not None and within not in text:
        return {}
    refs = {}
    for line in text.splitlines():
        if line[:1] in ("#", "^", ""):
            continue
        oid, _, name = line.partition(" ")
        name = name.rstrip()
        if not name or (within is not None and not name.startswith(within)) \
                or (exclude is not None and name.startswith(exclude)):
            continue
        refs[name] = oid
    return refs


def refs_are_files(common_dir):
    """True when the repository keeps refs as files (loose + packed-refs).

    False for the reftable backend (a `reftable` directory, or an
    extensions.refStorage other than "files" in the config) and whenever
    the config cannot be read: then git itself is asked.
    """
    if os.path.lexists(os.path.join(common_dir, "reftable")):
        return False
    data = read_file_or_none(os.path.join(common_dir, "config"))
    if data is None:
        return False
    section = None
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if line.startswith("["):
            end = line.find("]")
            section = line[1:end].strip().lower() if end > 0 else ""
            line = line[end + 1:].strip() if end > 0 else ""
        if section != "extensions" or not line or line[0] in "#;":
            continue
        key, _, value = line.partition("=")
        if key.strip().lower() == "refstorage":
            value = re.split(r"[#;]", value, maxsplit=1)[0].strip().strip('"').strip()
            if value.lower() != "files":
                return False
    return True


class _GitRunner:
    """Runs git for one workspace: argument lists, bytes, stderr in the error."""

    def __init__(self, root, store_dir, env):
        self.root = root
        self.top = root
        self.git_dir = self.common_dir = None
        self.refs_are_files = False
        self.oid_bytes = 20
        self.not_a_repo = None
        self.store_git = os.path.join(store_dir, "git")
        self.env = env
        # A hooks directory that does not exist: no hook of the user runs.
        self.config = GIT_FORCED_CONFIG + (
            "core.hooksPath=" + os.path.join(self.store_git, "no-hooks"),)

    def run(self, args, *, input=None, env=None, cwd=None, ok_codes=(0,)):
        argv = ["git"]
        for item in self.config:
            argv += ["-c", item]
        argv += list(args)
        import subprocess  # only in a git repository
        try:
            proc = subprocess.run(argv, cwd=cwd or self.root, env=env or self.env,
                                  input=input, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, stdin=None if input is not None
                                  else subprocess.DEVNULL, timeout=GIT_TIMEOUT)
        except FileNotFoundError:
            raise GitCommandFailed("git executable not found on PATH", missing=True)
        except subprocess.TimeoutExpired:
            raise GitCommandFailed("git %s did not finish within %d s and was stopped"
                                   % (args[0], GIT_TIMEOUT))
        except OSError as exc:
            raise GitCommandFailed("cannot run git: %s" % exc)
        if proc.returncode not in ok_codes:
            raise GitCommandFailed("git %s failed (exit %d): %s" % (
                args[0], proc.returncode, stderr_summary(proc.stderr)), stderr=proc.stderr)
        return proc.stdout, proc.returncode

    def discover(self):
        """The repository's common git dir (a cache key), or None outside a repo.

        Also learns the worktree's own git dir (HEAD, index), the common dir
        (shared refs, packed-refs, stash log), the top of the work tree and
        whether refs are plain files, all from one `rev-parse`.
        """
        try:
            out, _ = self.run(["rev-parse", "--show-object-format", "--git-dir",
                               "--git-common-dir", "--show-toplevel"])
        except GitCommandFailed as exc:
            if b"not a git repository" in exc.stderr:
                self.not_a_repo = str(exc)
                return None
            raise
        lines = out.decode("utf-8", "surrogateescape").splitlines()
        if len(lines) < 4:
            raise GitCommandFailed("git rev-parse gave no work tree for %r" % self.root)
        self.oid_bytes = 32 if lines[0].strip() == "sha256" else 20
        # The two dirs may be printed relative to the directory git ran in.
        self.git_dir = os.path.realpath(os.path.join(self.root, lines[1]))
        self.common_dir = os.path.realpath(os.path.join(self.root, lines[2]))
        self.top = lines[3]
        self.refs_are_files = refs_are_files(self.common_dir)
        return self.common_dir

    def fingerprint(self):
        """What must not change: HEAD, the user's index, every ref outside
        refs/checkpoints/, the stash. Read from the files when refs are
        files; through git for any other ref backend."""
        if self.refs_are_files:
            return self._fingerprint_from_files()
        return self._fingerprint_from_git()

    def _fingerprint_from_files(self):
        """No process: HEAD's content, a hash of the index file, the parsed
        refs and a hash of the stash reflog. Missing or unreadable files
        count as absent (None); nothing here raises.

        Refs are compared as {name: value}, loose files overlaid on
        packed-refs, so `git pack-refs` (same values, other file) is no
        change. Loose files are read before packed-refs: pack-refs writes
        the new packed-refs before it deletes the loose files, so a ref
        being packed is always seen in one place or the other.
        """
        refs = loose_refs(self.common_dir, "refs", exclude=GIT_REF_PREFIX)
        own = {}
        if self.git_dir != self.common_dir:
            # A linked worktree: its per-worktree refs (bisect, worktree/...).
            own = loose_refs(self.git_dir, "refs", exclude=GIT_REF_PREFIX)
        packed = packed_refs(self.common_dir, exclude=GIT_REF_PREFIX)
        packed.update(refs)
        head = read_file_or_none(os.path.join(self.git_dir, "HEAD"))
        return ("files",
                None if head is None else head.strip(),
                index_digest(os.path.join(self.git_dir, "index"), self.oid_bytes),
                packed, own,
                file_digest(os.path.join(self.common_dir, "logs", "refs", "stash")))

    def _fingerprint_from_git(self):
        """The same facts through git (a reftable repository). `worktree list`
        gives HEAD (commit and branch) without scanning the work tree."""
        heads, _ = self.run(["worktree", "list", "--porcelain"], cwd=self.top)
        index, _ = self.run(["ls-files", "-s", "-z"], cwd=self.top)
        refs, _ = self.run(["for-each-ref", "--format=%(objectname) %(refname)"],
                           cwd=self.top)
        user_refs = [line for line in refs.splitlines()
                     if not line.split(b" ", 1)[-1].startswith(GIT_REF_PREFIX.encode())]
        stash, _ = self.run(["stash", "list", "--format=%H %gd"], cwd=self.top)
        return ("git", heads, index, tuple(user_refs), stash)

    def task_refs(self, task_id):
        """{ref name: commit id} of every checkpoint ref of the task."""
        prefix = GIT_REF_PREFIX + task_id + "/"
        if self.refs_are_files:
            # Loose before packed, as in the fingerprint; a loose ref wins.
            loose = loose_refs(self.common_dir, prefix.rstrip("/"))
            refs = packed_refs(self.common_dir, within=prefix)
            refs.update(loose)
            return {name: value for name, value in refs.items()
                    if value is not None and _OBJECT_ID.match(value)}
        out, _ = self.run(["for-each-ref", "--format=%(objectname) %(refname)", prefix])
        refs = {}
        for line in out.decode("utf-8", "surrogateescape").splitlines():
            oid, _, name = line.partition(" ")
            refs[name] = oid
        return refs

    def hash_blobs(self, paths, kind="blob"):
        """Write the files as objects of `kind`; their ids in order.

        One process, or, for a first save's worth of files (at least
        SPLIT_HASHING), GIT_HASH_PROCESSES side by side: hashing and
        compressing is CPU work, and the number of processes still does
        not grow with the number of files."""
        if any("\n" in p or "\r" in p for p in paths):
            raise GitCommandFailed("a payload path contains a line break")
        parts = GIT_HASH_PROCESSES if len(paths) >= SPLIT_HASHING else 1
        if parts < 2:
            return self._hash_objects(paths, kind)
        results = [None] * parts

        def run(part):
            try:
                results[part] = self._hash_objects(paths[part::parts], kind)
            except BaseException as exc:  # re-raised by the caller's thread
                results[part] = exc

        threads = [threading.Thread(target=run, args=(part,), name="tc-git-hash")
                   for part in range(parts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        oids = [None] * len(paths)
        for part, got in enumerate(results):
            if isinstance(got, BaseException):
                raise got
            oids[part::parts] = got
        return oids

    def _hash_objects(self, paths, kind):
        data = "".join(p + "\n" for p in paths).encode("utf-8", "surrogateescape")
        out, _ = self.run(["hash-object", "-w", "-t", kind, "--no-filters", "--stdin-paths"],
                          input=data)
        oids = out.decode("ascii").split()
        if len(oids) != len(paths):
            raise GitCommandFailed("git hash-object returned %d ids for %d files"
                                   % (len(oids), len(paths)))
        return oids

    def make_trees(self, trees):
        """Write tree objects in one `hash-object -t tree`, children first.

        `trees` is [(expected id, rows)] as git_trees() gives them. The
        caller vouches that every object the rows name exists: git checks
        each tree's format, not its entries (a lookup per entry is what
        makes mktree and write-tree slow on loose objects). An id that
        differs from the one computed here is refused rather than committed.
        """
        os.makedirs(self.store_git, exist_ok=True)
        self._sweep_trees()
        paths = []
        try:
            for _, rows in trees:
                # ".tmp-": a crash leaves them to the store's sweep.
                fd, path = new_temp(self.store_git, ".tmp-tree-")
                paths.append(path)
                with open(fd, "wb") as fh:
                    fh.write(b"".join(b"%s %s\0" % (mode.lstrip("0").encode(), raw)
                                      + bytes.fromhex(oid) for mode, _, oid, raw in rows))
            made = self.hash_blobs(paths, kind="tree")
        finally:
            for path in paths:
                try:
                    remove_file(path)
                except OSError:  # the trees are written; the next call sweeps it
                    pass
        expected = [tree_id for tree_id, _ in trees]
        if made != expected:
            raise GitCommandFailed("git wrote trees %s, expected %s"
                                   % (" ".join(made[:3]), " ".join(expected[:3])))

    def _sweep_trees(self):
        """Remove tree files an earlier call could not (its removal refused).
        Refs are written under the store lock, so none of them is in use."""
        try:
            names = os.listdir(self.store_git)
        except OSError:
            return
        for name in names:
            if name.startswith(".tmp-tree-"):
                try:
                    remove_file(os.path.join(self.store_git, name))
                except OSError:
                    pass

    def commit_tree(self, tree, parent, message):
        args = ["commit-tree", "--no-gpg-sign", tree]
        if parent:
            args += ["-p", parent]
        text = git_message_text(message) or "checkpoint"
        out, _ = self.run(args, input=text.encode("utf-8") + b"\n")
        return out.decode("ascii").strip()

    def create_ref(self, ref, commit, message):
        """Create-only update; False when the ref already exists."""
        zero = "0" * len(commit)
        try:
            self.run(["update-ref", "-m", reflog_message(message), ref, commit, zero])
            return True
        except GitCommandFailed:
            _, code = self.run(["rev-parse", "--verify", "--quiet", ref], ok_codes=(0, 1))
            if code == 0:
                return False
            raise


# - - - The index, the repository's config, and what it ignores ---------------

# One entry of a git index: mode (4 bytes, big-endian), object id, stage
# (0, or 1-3 in a conflict) and path (bytes, relative to the top).
IndexEntry = collections.namedtuple("IndexEntry", "mode oid stage path")


def index_entries(data, oid_bytes, extensions=None):
    """Each entry of a git index file's bytes (versions 2 to 4), in order.

    A list passed as extensions receives the four-byte signature of every
    extension after the entries (b"link": a split index, whose other
    entries live in a shared file; b"sdir": a sparse index). Raises
    ValueError (or struct.error / IndexError) on anything else: another
    version, a truncated or damaged file. Stat data is not read.
    """
    if data[:4] != b"DIRC":
        raise ValueError("not an index")
    version, count = struct.unpack_from(">II", data, 4)
    if version not in (2, 3, 4):
        raise ValueError("index version %d" % version)
    make = tuple.__new__  # IndexEntry(...) without the Python-level __new__
    find = data.index
    pos, previous = 12, b""
    for _ in range(count):
        oid_end = pos + 40 + oid_bytes
        flags = (data[oid_end] << 8) | data[oid_end + 1]
        name = oid_end + 2
        if flags & 0x4000:
            if version < 3:
                raise ValueError("extended flags in a version 2 index")
            name += 2
        if version == 4:
            # Path compressed against the previous one: a varint of bytes to drop.
            byte = data[name]
            strip = byte & 0x7F
            name += 1
            while byte & 0x80:
                byte = data[name]
                strip = ((strip + 1) << 7) | (byte & 0x7F)
                name += 1
            if strip > len(previous):
                raise ValueError("bad path compression")
            end = find(b"\0", name)
            path = previous[:len(previous) - strip] + data[name:end]
            entry_end = end + 1
        else:
            end = find(b"\0", name)
            path = data[name:end]
            entry_end = pos + ((end - pos + 8) & ~7)  # NUL-padded to a multiple of 8
        if entry_end > len(data):
            raise ValueError("truncated index")
        yield make(IndexEntry, (data[pos + 24:pos + 28], data[oid_end - oid_bytes:oid_end],
                                (flags >> 12) & 3, path))
        previous, pos = path, entry_end
    if extensions is not None:
        stop = len(data) - oid_bytes
        while pos + 8 <= stop:
            signature = data[pos:pos + 4]
            size = int.from_bytes(data[pos + 4:pos + 8], "big")
            pos += 8 + size
            if pos > stop:
                raise ValueError("truncated index extension")
            extensions.append(signature)
        if pos != stop:
            raise ValueError("trailing bytes after the index extensions")


def index_checksum_ok(data, oid_bytes):
    """True when the index file ends with the hash of the rest (or with
    zeros, which index.skipHash writes)."""
    body, trailer = data[:-oid_bytes], data[-oid_bytes:]
    if len(data) < 12 + oid_bytes:
        return False
    if trailer == bytes(oid_bytes):
        return True
    algo = hashlib.sha256 if oid_bytes == 32 else hashlib.sha1
    return algo(body).digest() == trailer


_SPARSE_DIR_MODE = b"\x00\x00\x40\x00"  # a folder entry of a sparse index


def tracked_paths_from_index(data, oid_bytes):
    """The paths of an index file parsed here, or None when only git can
    tell them (a split or sparse index, an unknown version, a damaged file)."""
    if not index_checksum_ok(data, oid_bytes):
        return None
    extensions = []
    try:
        entries = list(index_entries(data, oid_bytes, extensions))
    except (ValueError, IndexError, struct.error):
        return None
    if b"link" in extensions or b"sdir" in extensions or any(
            entry.mode == _SPARSE_DIR_MODE for entry in entries):
        return None
    return [entry.path for entry in entries]


def tracked_paths_from_git(top):
    """The index paths as one `git ls-files -z --cached` in top lists them
    (a sparse index expanded, a split index joined), or None when git is
    missing or fails: the caller then knows no tracked path."""
    import subprocess  # only in a git repository
    try:
        proc = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=top,
                              env=git_environment(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=GIT_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return [path for path in proc.stdout.split(b"\0") if path]


_CONFIG_ESCAPES = {"n": "\n", "t": "\t", "b": "\b", "\\": "\\", '"': '"'}


def _config_value(raw):
    """A config value as git reads it: quotes removed, escapes applied,
    a comment (# or ;) outside quotes cut, outer blanks trimmed."""
    out, quoted, at = [], False, 0
    raw = raw.strip()
    while at < len(raw):
        char = raw[at]
        if char == '"':
            quoted = not quoted
        elif char == "\\" and at + 1 < len(raw):
            at += 1
            out.append(_CONFIG_ESCAPES.get(raw[at], raw[at]))
        elif char in "#;" and not quoted:
            break
        else:
            out.append(char)
        at += 1
    return "".join(out).rstrip() if not quoted else "".join(out)


def git_config(data):
    """{"section.key" or "section.subsection.key": last value} of a git
    config file's bytes; a key without "=" has the value None (true).
    Sections and keys are lower-cased, subsections kept. Include
    directives are not followed."""
    values, section = {}, None
    lines = data.decode("utf-8", "surrogateescape").split("\n")
    at = 0
    while at < len(lines):
        line = lines[at].strip()
        at += 1
        while line.endswith("\\") and at < len(lines):  # a value continued on the next line
            line = line[:-1] + lines[at].strip()
            at += 1
        if line.startswith("["):
            close = line.find("]")
            if close < 0:
                section = None
                continue
            header, line = line[1:close].strip(), line[close + 1:].strip()
            name, _, sub = header.partition(" ")
            if sub.strip().startswith('"'):
                section = name.lower() + "." + _config_value(sub)
            else:
                section = header.lower()  # [section] or the old [section.sub]
        if not line or line[0] in "#;" or section is None:
            continue
        key, equals, raw = line.partition("=")
        key = key.strip().lower()
        if key and (key[0].isalpha() and all(c.isalnum() or c == "-" for c in key)):
            values[section + "." + key] = _config_value(raw) if equals else None
    return values


def config_bool(value, default=False):
    """A git boolean: None (no "=") is true; yes/on/true/1... and no/off/false/0/""."""
    if value is None:
        return True
    low = value.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off", ""):
        return False
    try:
        return int(low, 0) != 0
    except ValueError:
        return default


# Where a work tree's git data lives: top of the work tree, its own git dir
# (HEAD, index) and the common dir (config, info/exclude), all absolute.
GitLocation = collections.namedtuple("GitLocation", "top git_dir common_dir")


def _gitfile_target(path):
    """The git dir a ".git" file names ("gitdir: <path>"), or None."""
    data = read_file_or_none(path)
    if data is None or not data.startswith(b"gitdir:"):
        return None
    target = os.fsdecode(data[7:].strip())
    return os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else None


def find_git_location(root):
    """The work tree root lies in, found as git finds it from there: the
    nearest folder up with a ".git" folder or "gitdir:" file naming a git
    dir (with HEAD), not crossing into another file system; None outside a
    work tree (GIT_DIR and the like play no part, as for every git process
    of ours)."""
    current = os.path.realpath(root)
    try:
        device = os.stat(current).st_dev
    except OSError:
        return None
    while True:
        dotgit = os.path.join(current, ".git")
        git_dir = dotgit if os.path.isdir(dotgit) else (
            _gitfile_target(dotgit) if os.path.isfile(dotgit) else None)
        if git_dir is not None and os.path.isfile(os.path.join(git_dir, "HEAD")):
            common = read_file_or_none(os.path.join(git_dir, "commondir"))
            common_dir = git_dir
            if common and common.strip():
                common_dir = os.path.normpath(
                    os.path.join(git_dir, os.fsdecode(common.strip())))
            return GitLocation(current, git_dir, common_dir)
        parent = os.path.dirname(current)
        if parent == current:
            return None
        try:
            if os.stat(parent).st_dev != device:
                return None
        except OSError:
            return None
        current = parent


class GitIgnoreCache:
    """What load_repo_ignores keeps from one scan to the next, owned by the
    caller (one per workspace, like the PathPolicy): the tracked set, by
    the index file's stat (inode, size, mtime, ctime) and what it was made
    for, and parsed ignore files by content. A race between threads costs a
    second parse, never a wrong answer (each value replaces the whole)."""

    RULES_KEPT = 256  # parsed files; a workspace's .gitignore files, with room to edit them

    def __init__(self):
        self._tracked = None  # (key, TrackedSet)
        self._rules = {}      # (base, ignore_case, bytes) -> IgnoreRules

    def parse(self, data, base, *, ignore_case=False):
        key = (base, ignore_case, data)
        rules = self._rules.get(key)
        if rules is None:
            rules = IgnoreRules.parse(data, base, ignore_case=ignore_case)
            if len(self._rules) >= self.RULES_KEPT:
                self._rules.clear()
            self._rules[key] = rules
        return rules

    def tracked(self, location, offset, *, ignore_case, oid_bytes):
        """The TrackedSet of the work tree's index for a root at offset."""
        index = os.path.join(location.git_dir, "index")
        try:
            st = os.stat(index)
            stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            stamp = None
        key = (index, stamp, offset, ignore_case, oid_bytes)
        hit = self._tracked
        if hit is not None and hit[0] == key:
            return hit[1]
        if stamp is None:
            tracked = TrackedSet(ignore_case=ignore_case)  # no index yet: nothing tracked
        else:
            data = read_file_or_none(index)
            paths = None if data is None else tracked_paths_from_index(data, oid_bytes)
            if paths is None:
                paths = tracked_paths_from_git(location.top)
            tracked = TrackedSet.from_index_paths(paths or (), offset, ignore_case=ignore_case,
                                                  known=paths is not None)
        self._tracked = (key, tracked)
        return tracked


# What a scan of a workspace in a git work tree needs: where the repository
# is, the workspace root's place below its top (offset, "" or "a/b"), the
# stack that the root folder's own .gitignore extends (info/exclude and the
# files above the root; "everything" when the root lies in an ignored
# folder), the tracked paths, and watched: the files outside the workspace
# whose change alters the decisions (index, info/exclude, config, the
# .gitignore files above the root).
RepoIgnores = collections.namedtuple(
    "RepoIgnores", "location offset ignore_case stack tracked watched")


def _repository_config(location):
    """The repository's config values: the common config, then the
    worktree's own config.worktree when extensions.worktreeConfig is on."""
    values = git_config(read_file_or_none(os.path.join(location.common_dir, "config")) or b"")
    if config_bool(values.get("extensions.worktreeconfig", "false")):
        values.update(git_config(
            read_file_or_none(os.path.join(location.git_dir, "config.worktree")) or b""))
    return values


def load_repo_ignores(root, *, cache=None):
    """The ignore decisions for a scan of root (see RepoIgnores), or None
    when root is not in a git work tree (or is in a bare repository's
    folder). Reads the config (core.ignoreCase; extensions.objectFormat
    for the index), info/exclude, each .gitignore from the top down to
    root's parent, and the tracked set (from cache when the index is
    unchanged). root's own .gitignore is read by the walk, like any other."""
    location = find_git_location(root)
    if location is None:
        return None
    cache = cache if cache is not None else GitIgnoreCache()
    config = _repository_config(location)
    if location.git_dir == location.common_dir and config_bool(config.get("core.bare", "false")):
        return None  # a linked worktree is a work tree whatever the common config says
    ignore_case = config_bool(config.get("core.ignorecase", "false"))
    oid_bytes = 32 if (config.get("extensions.objectformat") or "").lower() == "sha256" else 20
    real_root = os.path.realpath(root)
    offset = os.path.relpath(real_root, location.top).replace(os.sep, "/")
    offset = "" if offset == "." else offset
    exclude_path = os.path.join(location.common_dir, "info", "exclude")
    watched = [os.path.join(location.git_dir, "index"), exclude_path,
               os.path.join(location.common_dir, "config")]
    rules = []
    exclude = read_file_or_none(exclude_path)
    if exclude:
        rules.append(cache.parse(exclude, "", ignore_case=ignore_case))
    stack = IgnoreStack(rules, ignore_case=ignore_case, parse=cache.parse)
    folder = ""
    for part in offset.split("/") if offset else ():
        here = os.path.join(location.top, *folder.split("/")) if folder else location.top
        watched.append(os.path.join(here, ".gitignore"))
        stack = stack.child(folder, read_ignore_file(os.path.join(here, ".gitignore")))
        folder = folder + "/" + part if folder else part
        if stack.ignored(folder, part, True):
            stack = stack.below_ignored()
    tracked = cache.tracked(location, offset, ignore_case=ignore_case, oid_bytes=oid_bytes)
    return RepoIgnores(location, offset, ignore_case, stack.rebased(offset), tracked,
                       tuple(watched))


# ---------------------------------------------------------------------------
# 13. Handoff format: the handoff text, HANDOFF.md, reading and checking a package
# ---------------------------------------------------------------------------

PACKAGE_FORMAT = 1
PACKAGE_DESCRIPTION = "handoff.json"

def indented(text):
    """A text whose further lines are indented (in a list item of HANDOFF.md
    or a line of a handoff, they stay in it instead of starting lines of
    their own)."""
    return "\n  ".join((text or "").splitlines())


HANDOFF_FIELD_BYTES = 2000  # bytes of one text of a handoff, as JSON (the result has it whole)
HANDOFF_LIST_BYTES = 4000  # ... and of one list of paths


def json_text_size(text):
    """Bytes text takes inside a JSON string sent as UTF-8 (a control
    character takes six, a quote two)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass")) - 2


def json_text_prefix(text, limit):
    """The longest start of text that takes at most limit bytes as JSON."""
    if json_text_size(text) <= limit:
        return text
    low, high = 0, min(len(text), limit)
    while low < high:  # the longest fitting length lies in [low, high]
        middle = (low + high + 1) // 2
        if json_text_size(text[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    return text[:low]


def handoff_field(text, *, one_line=False):
    """A text as a handoff shows it: a name or title on one line (line
    breaks and control characters written as escapes), a longer text with
    its further lines indented, so that no text can start a line of its own
    such as "Next step:"; cut to HANDOFF_FIELD_BYTES, so that the handoff
    stays small enough to be given whole (see tc_mcp.fit_result)."""
    text = shown_path(text or "") if one_line else indented(text)
    kept = json_text_prefix(text, HANDOFF_FIELD_BYTES)
    more = len(text) - len(kept)
    return kept + (" [... %d more characters]" % more if more else "")


def _path_list(paths, shown=20):
    """Up to shown paths, within HANDOFF_LIST_BYTES (a longer path is cut),
    and how many more there are; "none" for no path."""
    if not paths:
        return "none"
    items, size = [], 0
    for path in paths[:shown]:
        item = shown_path(path)
        if size + json_text_size(item) > HANDOFF_LIST_BYTES:
            if not items:  # one path longer than the whole list may be
                items.append(json_text_prefix(item, HANDOFF_LIST_BYTES) + "...")
            break
        items.append(item)
        size += json_text_size(item) + 2
    more = len(paths) - len(items)
    return ", ".join(items) + (" (+%d more)" % more if more else "")


def by_agent(record):
    """" by <agent>" when the record names who made it, else ""."""
    agent = record.get("agent")
    return " by %s" % handoff_field(agent, one_line=True) if agent else ""


def _changes_list(paths, gone):
    """paths for a handoff line, those in gone (no longer on disk) named
    apart, so that a deletion does not read as an edit."""
    if not gone or not paths:
        return _path_list(paths)
    there = [path for path in paths if path not in gone]
    deleted = [path for path in paths if path in gone]
    if not there:
        return "deleted: " + _path_list(deleted)
    if not deleted:
        return _path_list(there)
    return "%s; deleted: %s" % (_path_list(there), _path_list(deleted))


def handoff_text(state, last, drift_paths, changed=None, *, unread=None, unseen=(),
                 gone=frozenset()):
    """Plain text a person can paste into a new session. changed: the paths
    that differ from the current step, recorded or not; shown when the drift
    layer recorded some of them (else it is the same list as drift_paths).
    unread: why the workspace could not be listed, when it could not (what
    is not recorded is then unknown, not none); unseen: the folders and
    files in it the scan could not read (named, since what changed in them
    is unknown); gone: the paths of those lists no longer on disk."""
    lines = ["Task: %s" % handoff_field(state.get("name", ""), one_line=True),
             "Goal: %s" % (handoff_field(state.get("goal")) or "(not stated)")]
    if state.get("constraints"):
        lines.append("Constraints: %s" % handoff_field(state["constraints"]))
    if last:
        lines.append("Current step: %d (%s)%s" % (
            last["index"], handoff_field(last.get("title", ""), one_line=True), by_agent(last)))
        if last.get("conclusion"):
            lines.append("Conclusion: %s" % handoff_field(last["conclusion"]))
        lines.append("Next step: %s" % (handoff_field(last.get("next")) or "(not stated)"))
    else:
        lines += ["Current step: none saved yet", "Next step: (not stated)"]
    if last and changed and changed != drift_paths:
        lines.append("Changed since step %d: %s" % (last["index"], _changes_list(changed, gone)))
    if unread:
        lines.append("Not yet recorded: unknown (the workspace could not be read: %s)" % unread)
    else:
        lines.append("Not yet recorded: %s" % _changes_list(drift_paths, gone) + (
            " (not read: %s)" % _path_list(list(unseen)) if unseen else ""))
    return "\n".join(lines)


def sensitive_now(entries, policy):
    """entries with every stored file that policy now takes for sensitive
    shown as a sensitive one (no content, no hash): a record made under an
    older list must not carry such a file's content into a package, which
    every workspace then refuses (refuse_foreign_paths)."""
    now = {rel: manifest_entry(KIND_SENSITIVE, None, entry.size, entry.mode, entry.mtime_ns)
           for rel, entry in entries.items()
           if entry.kind == KIND_FILE and policy.sensitive(rel)}
    return dict(entries, **now) if now else entries


def handoff_markdown(desc, left_out=()):
    """HANDOFF.md of a package; left_out: the paths that had changed in the
    sender's workspace since the packed step, so are not in the package."""
    task, step = desc["task"], desc.get("step") or {}
    out = ["# Handoff: %s" % handoff_field(task["name"], one_line=True), "",
           "You are taking over a task that was checkpointed with task-checkpoint-mcp. "
           "The files of its current step are in `files/`.", "",
           "- Goal: %s" % (handoff_field(task.get("goal")) or "(not stated)")]
    if task.get("constraints"):
        out.append("- Constraints: %s" % handoff_field(task["constraints"]))
    if step:
        out += ["- Current step: %d, %s%s" % (step["index"],
                                              handoff_field(step.get("title"), one_line=True),
                                              by_agent(step)),
                "- Last conclusion: %s" % (handoff_field(step.get("conclusion")) or "(none)"),
                "- Next step: %s" % (handoff_field(step.get("next")) or "(not stated)")]
    for question in step.get("open_questions") or []:
        out.append("- Open question: %s" % handoff_field(question))
    out += ["", "## Files", "", "%d file(s) are included." % len(desc["files"])]
    if desc["filtered"]:
        out += ["", "Left out on purpose; do not go looking for them, ask the owner if needed:"]
        out += ["- `%s` (%s)" % (shown_path(f["path"]), f["reason"]) for f in desc["filtered"]]
    if left_out:
        out += ["", "Changed in the sender's workspace after this step, so not in this "
                "package (%d; ask the sender to save and export again if you need them):"
                % len(left_out)]
        out += ["- `%s`" % shown_path(path) for path in left_out[:100]]
        if len(left_out) > 100:
            out.append("- ... and %d more" % (len(left_out) - 100))
    out += ["", "## Continue", "",
            "Call `tc_import` with `root` set to your workspace and `package` set to this "
            "directory, then `tc_resume`, and carry on from the next step above.", ""]
    return "\n".join(out)


def copy_tree_file(payloads, sha, dest, mode, made=None):
    """copy_out into a tree, creating dest's folder (once per folder with made)."""
    folder = os.path.dirname(dest)
    if made is None or folder not in made:
        make_dirs(folder)
        if made is not None:
            made.add(folder)
    payloads.copy_out(sha, dest, mode)


def package_files(base):
    """Every regular file of a package directory, as a path relative to it
    ("files/src/app.py"); a symlink anywhere in it is refused. One listing
    per folder: the file types come from the listing itself. A folder that
    cannot be listed is left out (a file listed inside it is then missing)."""
    files = set()
    stack = [""]
    while stack:
        prefix = stack.pop()
        try:
            it = os.scandir(os.path.join(base, prefix) if prefix else base)
        except OSError:
            if not prefix:
                raise
            continue  # a folder it cannot list holds nothing it can import
        with it:
            for entry in it:
                rel = prefix + entry.name
                if entry.is_symlink():
                    raise UnsafePath("the package contains a symlink %r; refusing it" % rel)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(rel + "/")
                elif entry.is_file(follow_symlinks=False):
                    files.add(rel)
    return files


def package_entry(package, listing, rel):
    """The path of the package file rel ("files/...") listed by package_files."""
    if rel not in listing:
        raise InvalidArgument("the package lacks the file %r it lists" % rel)
    return os.path.join(package, *rel.split("/"))


def refuse_foreign_paths(desc, policy):
    """Refuse a package that would write where no record of this workspace
    may hold content: .git or the store (at any depth), or a sensitive
    name. A path only a name rule leaves out here (a build/ folder git
    tracked where the package was made) is written: it is what the sender's
    steps hold, and nothing of it is lost by landing outside this
    workspace's scans."""
    paths = [item["path"] for item in desc["files"]]
    for entry in desc.get("history") or []:
        paths.extend(p for p, e in entry["files"].items() if e.kind == KIND_FILE)
    for rel in paths:
        if policy.own_path(rel) or policy.sensitive(rel):
            raise UnsafePath("the package would write %r, which is git's, the store's or "
                             "sensitive in this workspace; nothing was imported" % rel)


def load_package(package):
    """Parse and check a handoff package completely before anything is written.

    Refused: an unknown format version; a task id that is not one a new
    task may have, a task without a name, a goal or constraints that are
    not text, an invalid last step number or exclude pattern; a symlink
    anywhere in the package; a path that is absolute, holds an empty, '.'
    or '..' segment or is listed twice; a file entry whose mode, size or
    sha256 is not in the store's form, or whose file is missing or of
    another size; in the history, a malformed step or file entry, a step
    listed twice, no current step, carried content that does not match its
    name, or a size its content does not have. The files' bytes are
    checked against their hashes as they are copied in, and where they may
    land in the receiving workspace by refuse_foreign_paths."""
    if not os.path.isdir(package):
        raise InvalidArgument("package %r is not a directory made by tc_export" % package)
    described = os.path.join(package, PACKAGE_DESCRIPTION)
    if os.path.islink(described):
        raise UnsafePath("the package contains a symlink %r; refusing it" % PACKAGE_DESCRIPTION)
    try:
        desc = read_json(described)
    except FileNotFoundError:
        raise InvalidArgument("package %r has no %s; pass the directory tc_export returned"
                              % (package, PACKAGE_DESCRIPTION)) from None
    except StoreCorrupt as exc:
        raise InvalidArgument("package description is damaged: %s" % exc) from None
    listing = package_files(package)
    try:
        return _check_description(package, desc, listing)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgument("package description is malformed (%s: %s)"
                              % (exc.__class__.__name__, exc)) from None


def _check_step(step, where):
    """A step record from a package: the fields a stored step has (its
    manifest number is given on import), so the store it lands in reads it."""
    if not isinstance(step, dict):
        raise InvalidArgument("%s is not a step record" % where)
    index = step.get("index")
    if not isinstance(index, int) or isinstance(index, bool) or index < 1:
        raise InvalidArgument("%s has no valid step number (got %r)" % (where, index))
    problem = shape_problem(dict(step, manifest=0), STEP_SHAPE)
    if problem is not None:
        raise InvalidArgument("%s is malformed (%s)" % (where, problem))


def _check_description(package, desc, listing):
    if not isinstance(desc, dict) or type(desc.get("format")) is not int \
            or desc["format"] != PACKAGE_FORMAT:
        raise InvalidArgument("package format %r is not supported (expected %d)"
                              % (desc.get("format") if isinstance(desc, dict) else None,
                                 PACKAGE_FORMAT))
    _check_package_task(desc["task"])
    if desc.get("step") is not None:
        _check_step(desc["step"], "the package's current step")
    sizes = _check_package_files(package, desc, listing)
    _check_package_history(package, desc, listing, sizes)
    return desc


def _check_package_task(task):
    validate_task_id(task["task_id"], "the package's task id", new=True)
    if not isinstance(task.get("name"), str) or not task["name"].strip():
        raise InvalidArgument("the package's task has no name")
    for key in ("goal", "constraints"):
        if task.get(key) is not None and not isinstance(task[key], str):
            raise InvalidArgument("the package's task %s is not text" % key)
    last = task.get("last_step")
    if last is not None and not (_whole(last) and last <= MAX_STEP):
        raise InvalidArgument("the package's task has no valid last step number (got %s)"
                              % repr(last)[:40])
    PathPolicy.check_patterns(task.get("exclude") or [])


def _check_package_files(package, desc, listing):
    """Check the package's file list against its files; returns sha -> the
    size of its content, as the package's files have it."""
    if not isinstance(desc["files"], list):
        raise InvalidArgument("the package's file list is malformed")
    seen = set()
    sizes = {}
    for item in desc["files"]:
        rel = normalize_rel(item["path"])
        if rel in seen:
            raise InvalidArgument("the package lists %r twice" % rel)
        seen.add(rel)
        if not (_whole(item["mode"]) and _whole(item["size"])
                and type(item["sha256"]) is str and _SHA256.match(item["sha256"])):
            raise InvalidArgument("the package entry %r is malformed" % rel)
        # Its bytes are checked against sha256 while they are copied in; a
        # mismatch fails the import, whose journal then undoes it.
        size = os.lstat(package_entry(package, listing, "files/" + rel)).st_size
        if size != item["size"] or sizes.setdefault(item["sha256"], size) != size:
            raise InvalidArgument("the package entry %r gives %d bytes, its file has %d"
                                  % (rel, item["size"], size))
    return sizes


def _check_package_history(package, desc, listing, sizes):
    """Check the package's history: its steps, their file entries, and the
    content it carries (hashed here; sizes gains each one's size)."""
    history = desc.get("history") or []
    for entry in history:
        _check_step(entry["step"], "a step in the package's history")
        for rel in entry["files"]:
            normalize_rel(rel)
        if type(entry["files"]) is not dict or not entries_ok(entry["files"].values(), 5):
            raise InvalidArgument("the package history of step %d has a malformed file "
                                  "entry" % entry["step"]["index"])
        entry["files"] = {rel: as_entry(item) for rel, item in entry["files"].items()}
    numbers = [entry["step"]["index"] for entry in history]
    if len(set(numbers)) != len(numbers):
        raise InvalidArgument("the package history lists a step twice")
    if numbers and desc.get("step") is not None and desc["step"]["index"] not in numbers:
        raise InvalidArgument("the package history lacks its current step %d"
                              % desc["step"]["index"])
    for sha in carried_history_shas(package, desc):
        full = package_entry(package, listing, "history/payload/" + sha)
        digest, sizes[sha] = hash_file(full)
        if digest != sha:
            raise InvalidArgument("the package content %s does not match its hash" % sha[:12])
    for entry in history:
        for rel, item in entry["files"].items():
            if item.kind == KIND_FILE and sizes.get(item.sha, item.size) != item.size:
                raise InvalidArgument("the package history of step %d gives %r a size its "
                                      "content does not have" % (entry["step"]["index"], rel))


def package_history_shas(desc):
    """The content the package's history names, sorted (its entries checked
    by _check_package_history)."""
    return sorted({value.sha for entry in desc.get("history") or []
                   for value in entry["files"].values() if value.kind == KIND_FILE})


def carried_history_shas(package, desc):
    """History content the package carries. A step whose content was already
    gone when it was exported is imported too; its missing files are then
    reported as unrestorable, like at the source."""
    return [sha for sha in package_history_shas(desc)
            if os.path.lexists(os.path.join(package, "history", "payload", sha))]


# ---------------------------------------------------------------------------
# 14. Recorder: how a workspace becomes records
# ---------------------------------------------------------------------------

# entries: rel -> manifest entry; rows: rel -> index row; reads: files read;
# skipped: [{"path", "reason"}]; stamp_ns: the index's clock stamp;
# created: payload paths written for this snapshot.
# unseen: paths it could not read, folders ending in "/" (see carry_unknown);
# left_out: what the scan left out by name (ScanResult.left_out).
# What a save reports as left out of its records, in this order (see
# Recorder.newly_left_out): by kind of entry, or by what a scan left out.
LEFT_OUT_ORDER = (KIND_SENSITIVE, KIND_BIG, "name", "folder")
LEFT_OUT_REASONS = {
    KIND_SENSITIVE: "sensitive name: only its size and time are recorded, never its content, "
                    "so a restore leaves it as it is",
    KIND_BIG: "over 100 MB: only its hash is recorded, so it cannot be restored",
}
# git: the scan's GitView (None outside git); dropped: paths the index had
# that git's ignore rules now leave out, which are neither kept nor counted
# as deleted (see Recorder.base_entries).
Snapshot = collections.namedtuple("Snapshot",
                                  "entries rows reads skipped stamp_ns created unseen left_out "
                                  "git dropped")


def vouched_rows(scanned, old_rows, old_entries, trusted):
    """(entries, rows, to_read) of a snapshot before any file is read:
    sensitive files by size and mtime; files the stat cache vouches for
    (trusted(row, info), None to trust nothing) keep their old row and
    entry objects when nothing else changed, so comparing with the index
    is mostly identity checks; to_read lists (rel, info) of the rest."""
    entries, rows, to_read = {}, {}, []
    for rel, info in scanned.items():
        if info.sensitive:  # size and mtime only, never read
            rows[rel] = index_row(info, KIND_SENSITIVE, None)
            entries[rel] = manifest_entry(KIND_SENSITIVE, None, info.size, info.mode,
                                          info.mtime_ns)
            continue
        row = old_rows.get(rel)
        if row is not None and trusted is not None and row.kind != KIND_SENSITIVE \
                and trusted(row, info):
            if (row.mode == info.mode and row.ctime_ns == info.ctime_ns and row.ino == info.ino
                    and row.dev == info.dev):
                rows[rel] = row
                entries[rel] = old_entries[rel]
            else:
                rows[rel] = index_row(info, row.kind, row.sha)
                entries[rel] = manifest_entry(row.kind, row.sha, info.size, info.mode)
            continue
        to_read.append((rel, info))
    return entries, rows, to_read


def carry_unknown(paths, old_rows, old_entries, rows, entries):
    """Give the paths a scan could not read (files, and folders ending in
    "/") their last known entries: a file nobody could look at is not a
    deletion, and a later restore of the record must not remove it. Their
    rows get a ctime no file has, so the stat cache never vouches for them:
    the first scan that can read them does."""
    unseen = unseen_test(paths)
    for rel, row in old_rows.items():
        if rel not in rows and unseen(rel):
            entry = old_entries.get(rel)
            if entry is not None:
                rows[rel] = row.unvouched()
                entries[rel] = entry


def rows_outside(within, index_doc, old_entries, rows, entries):
    """Give every indexed file outside the scope within that the snapshot
    did not look at its index row and entry, as last known.
    A row its index could not vouch for (a time at or after the index's
    stamp) gets a ctime no file has, so that a later stamp does not make it
    trusted: the next scan reads that file."""
    stamp = index_doc.get("stamp_ns", 0)
    for rel, row in index_doc["files"].items():
        if rel not in rows and rel not in within:
            rows[rel] = (row if row.mtime_ns < stamp and row.ctime_ns < stamp
                         else row.unvouched())
            entries[rel] = old_entries[rel]


def seen_as(row):
    """What an operation checks a file against before it writes or removes
    it: (size, mtime) of its snapshot row, or None where the snapshot saw no
    file. Not the ctime or the inode: the operation's own work on other
    names of a hard-linked file moves the ctime, and so do a chmod or an
    extended attribute another program sets; some file systems renumber
    inodes. A writer moves the mtime."""
    return None if row is None else (row.size, row.mtime_ns)


def index_after_writes(ws, rows, written, scanned_ns, overwritten=()):
    """The index to keep after a restore or an import wrote the files in
    written (their rows hold the stat taken after the last change).

    Its stamp is read now, after those writes, so a written file whose
    times are older than the stamp is trusted by the next scan like any
    file recorded before its index was written, instead of being read
    back. A row the scan before the writes could not trust (a time at or
    after scanned_ns, the stamp of that scan) must not turn trusted under
    the later stamp: its ctime becomes one no file has, so the next scan
    reads that file. So does the row of a written file over
    WRITTEN_TRUST_LIMIT bytes: it took several writes, and another
    program writing it meanwhile would leave bytes that are neither the
    stored content nor its own, under the stat of our last write. And so
    does the row of a file in overwritten, written over its old bytes in
    place: nothing flushed those writes, and a file system orders such
    writes after nothing, so a power cut or a disk error could leave the
    old bytes under the new stat (a new file, or a longer one, shows its
    loss in its size)."""
    stamp = ws.store.clock_stamp(ws.root)
    settled = {}
    for rel, row in rows.items():
        if rel in written:
            if row.size > WRITTEN_TRUST_LIMIT or rel in overwritten:
                row = row.unvouched()
        elif row.mtime_ns >= scanned_ns or row.ctime_ns >= scanned_ns:
            row = row.unvouched()
        settled[rel] = row
    return {"stamp_ns": stamp, "files": settled}


class Recorder:
    """How a workspace becomes records: a snapshot (scan, then read what
    the stat cache cannot vouch for, storing its content), the index that
    caches it, and the manifest and drift records that keep it. Every
    operation that records the workspace goes through here."""

    GIT_CACHES_KEPT = 64  # workspaces whose parsed ignore files and tracked paths are kept

    def __init__(self, config, policies, log):
        self.config = config
        self.policies = policies
        self.log = log
        self._git_caches = collections.OrderedDict()  # root -> GitIgnoreCache
        self._git_lock = threading.Lock()

    def git_view(self, ws):
        """A GitView of ws's workspace for one scan, or None outside a git
        work tree or with TC_GITIGNORE=off. What cannot be read of the
        repository (a damaged config, say) leaves the scan without ignore
        rules, as outside git, and is logged."""
        if not self.config.gitignore:
            return None
        with self._git_lock:
            cache = self._git_caches.pop(ws.root, None) or GitIgnoreCache()
            self._git_caches[ws.root] = cache
            while len(self._git_caches) > self.GIT_CACHES_KEPT:
                self._git_caches.popitem(last=False)
        try:
            repo = load_repo_ignores(ws.root, cache=cache)
        except (OSError, ValueError, UnicodeError) as exc:
            self.log("git's ignore rules of %r could not be read, so none apply: %s"
                     % (ws.root, exc))
            return None
        return None if repo is None else GitView(ws.root, repo)

    @staticmethod
    def base_entries(old_entries, snap):
        """The index's entries that snap is compared with to say what was
        added, changed or deleted: without the paths git now ignores."""
        if not snap.dropped:
            return old_entries
        return {rel: entry for rel, entry in old_entries.items() if rel not in snap.dropped}

    def trust_test(self, stamp_ns, strict):
        """The test that lets an indexed row stand for a scanned file without
        reading it, or None when every file must be read. strict (restores)
        never settles for TC_SHA_REUSE's mtime+size: an undo must hold real
        bytes. The default is git's stat cache: all five stat fields equal and
        neither time at or after the moment the index was written (racily clean)."""
        if self.config.full_hash:
            return None
        if self.config.sha_reuse and not strict:
            return lambda row, info: row.size == info.size and row.mtime_ns == info.mtime_ns
        if not STAT_CACHE_SUPPORTED:
            return None
        # Equal to the stat first: the time comparisons then compare numbers.
        return lambda row, info: (row.mtime_ns == info.mtime_ns
                                  and row.ctime_ns == info.ctime_ns
                                  and row.size == info.size and row.ino == info.ino
                                  and row.dev == info.dev and row.mtime_ns < stamp_ns
                                  and row.ctime_ns < stamp_ns)

    @gc_paused
    def snapshot(self, ws, *, store_content, strict=False, within=None):
        """Entries and index rows of the workspace as it is now.

        Re-reads only files the stat cache cannot vouch for; stores content of
        what it reads when store_content is set (sensitive files never read).
        A file the cache vouches for keeps its old row and entry objects, so
        comparing the result with the index is mostly identity checks.
        within (a PathScope): only the files in it are looked at; every other
        file keeps its index row and entry (see rows_outside), so the result
        describes them as last known.
        """
        # A preview writes nothing, not even the clock file; its rows are not kept.
        stamp_ns = (ws.store.clock_stamp(ws.root) if store_content
                    else time.time_ns() - RACY_MARGIN_NS)
        scan = scan_tree(ws.root, self.policies.of(ws), within=within, git=self.git_view(ws))
        index_doc = ws.records.read_index()
        old_rows = index_doc["files"]
        old_entries = ws.records.index_entries(index_doc)
        trusted = self.trust_test(index_doc.get("stamp_ns", 0), strict)
        entries, rows, to_read = vouched_rows(scan.files, old_rows, old_entries, trusted)
        if within is not None:
            rows_outside(within, index_doc, old_entries, rows, entries)
        skipped, created = list(scan.skipped), []
        reads = 0

        def read(item):
            rel, info = item
            try:
                return self.read_file(ws, rel, info, store_content, created)
            except OSError as exc:
                return exc

        try:
            got_all = in_parallel(read, to_read)
        except BaseException:  # a full store, a cancel: what was stored is nobody's yet
            ws.store.payloads.discard(created)
            raise
        unreadable = list(scan.unreadable)
        for (rel, info), got in zip(to_read, got_all):
            if isinstance(got, OSError):
                skipped.append({"path": rel, "reason": "unreadable: %s" % describe_os_error(got)})
                if got.errno not in VANISHED_ERRNOS:
                    unreadable.append(rel)
                continue
            kind, sha, size, mode = got
            reads += 1
            rows[rel] = index_row(info._replace(size=size, mode=mode), kind, sha)
            entries[rel] = manifest_entry(kind, sha, size, mode)
        if unreadable:
            carry_unknown(unreadable, old_rows, old_entries, rows, entries)
        dropped = frozenset()
        if scan.git is not None:
            dropped = frozenset(rel for rel in old_rows
                                if rel not in rows and scan.git.ignored(rel))
        return Snapshot(entries, rows, reads, skipped, stamp_ns, created, unreadable,
                        scan.left_out, scan.git, dropped)

    def secure_undo(self, ws, snap, rels):
        """Make sure the content the snapshot names for rels (files about to be
        overwritten or deleted) is in the store, re-reading any whose stored
        copy is gone (reclaimed by tc_compress) or damaged. Only these files are checked,
        not the whole workspace. Returns (snapshot, True when an entry changed)."""
        entries, rows = snap.entries, snap.rows
        wanted = {}
        for rel in rels:
            entry = entries.get(rel)
            if entry is not None and entry.kind == KIND_FILE:
                wanted.setdefault(entry.sha, []).append(rel)
        changed, reads = False, snap.reads
        payloads = ws.store.payloads
        gone = []
        for sha, users in wanted.items():  # one stat each: there, and of the right size
            size = payloads.size(sha)
            if size is not None and size != entries[users[0]].size:
                # A stored copy of the wrong size is damaged: the file itself
                # is the one good copy left, so it is stored again.
                ws.store.log("stored content %s is damaged (wrong size); it is stored again "
                             "from %r" % (sha, users[0]))
                remove_file(payloads.path(sha))
                size = None
            if size is None:
                gone.append(sha)
        for sha in gone:
            for rel in wanted[sha]:
                row = rows[rel]
                info = StatInfo(row.size, row.mtime_ns, row.ctime_ns, row.ino, row.dev, row.mode,
                                False)
                try:
                    kind, new_sha, size, mode = self.read_file(ws, rel, info, True, snap.created)
                except OSError as exc:
                    raise Conflict("%r could not be read to keep its current content (%s); "
                                   "nothing was changed" % (rel, describe_os_error(exc))) from None
                reads += 1
                rows[rel] = index_row(info._replace(size=size, mode=mode), kind, new_sha)
                entries[rel] = manifest_entry(kind, new_sha, size, mode)
                changed = changed or new_sha != sha
        return snap._replace(reads=reads), changed

    def read_file(self, ws, rel, info, store_content, created):
        """(kind, sha, size, mode) of a scanned file, its content stored when
        store_content. A file that changes while it is read is read again,
        up to READ_TRIES times in all; then it counts as unreadable
        (ChangedWhileRead), so what a record holds is a state the file had."""
        for tries_left in range(READ_TRIES - 1, -1, -1):
            try:
                return self.read_file_once(ws, rel, info, store_content, created)
            except ChangedWhileRead:
                if not tries_left:
                    raise
            # A writer caught mid-save may finish meanwhile; a cancel ends the wait.
            event = cancel_event()
            pause = 0.05 * (READ_TRIES - tries_left)
            if event is None:
                time.sleep(pause)
            elif event.wait(pause):
                raise Cancelled(CANCELLED_TEXT)

    def read_file_once(self, ws, rel, info, store_content, created):
        full = os.path.join(ws.root, *rel.split("/"))
        seen = (info.dev, info.ino)
        if info.size > MAX_CONTENT_BYTES:
            sha, size = hash_file(full, within=ws.guard, seen=seen, whole=True)
            return KIND_BIG, sha, size, info.mode
        if not store_content:
            sha, size = hash_file(full, within=ws.guard, seen=seen, whole=True)
            return KIND_FILE, sha, size, info.mode
        sha, size, mode, written = ws.store.payloads.put_file(full, within=ws.guard, seen=seen,
                                                              whole=True)
        if written:
            created.append(written)
        if size > MAX_CONTENT_BYTES:  # grew while being read
            return KIND_BIG, sha, size, mode
        return KIND_FILE, sha, size, mode

    def write_index(self, ws, snap, old_index):
        """Rewrite the index when a row changed or a racy row can now be trusted.

        Called once the state has moved, so the save or capture is recorded
        whatever happens here; the index is a cache, and a failed write of it
        (a disk filling up just now) leaves the old one, which the next scan
        corrects by reading what it cannot vouch for."""
        old_stamp = old_index.get("stamp_ns", 0)
        if snap.rows != old_index["files"] or any(
                row.mtime_ns >= old_stamp or row.ctime_ns >= old_stamp
                for row in snap.rows.values()):
            self.keep_index(ws, {"stamp_ns": snap.stamp_ns, "files": snap.rows},
                             entries=snap.entries)

    @staticmethod
    def keep_index(ws, index_doc, *, entries=None, whole=False):
        """write_index, as a cache: a failure is logged, never the operation's."""
        try:
            ws.records.write_index(index_doc, entries, whole=whole)
        except OSError as exc:
            ws.store.log("the index of task %s was not rewritten (%s); the next scan reads "
                         "what it cannot vouch for" % (ws.task_id, describe_os_error(exc)))

    def record_manifest(self, ws, state, entries, later=None):
        """Write the next manifest. Without `later`, the payloads it names are
        flushed before it and it is made durable at once; with a list, the
        caller flushes payloads and records together (flush_with) before the
        state that points at them is written."""
        if later is None:
            ws.store.payloads.flush()
        number = state["last_manifest"] + 1
        ws.records.manifests.append(number, entries, base=state["last_manifest"], later=later)
        state["last_manifest"] = number
        return number

    def record_drift(self, ws, state, entries, old_entries, *, kind, partial=False,
                      head_before=None, reason=None, lists=None, later=None, unseen=(),
                      agent=None, label=None, paths=None):
        """Write a manifest and a drift record for entries; returns the record.

        lists (added, modified, deleted) overrides the diff against old_entries.
        later: see _record_manifest. agent, label, paths: see make_drift.
        """
        added, modified, deleted = lists or diff_maps(old_entries, entries)
        number = self.record_manifest(ws, state, entries, later)
        drift_no = state["last_drift"] + 1
        drift = make_drift(number=drift_no, kind=kind, manifest=number, added=added,
                           modified=modified, deleted=deleted, partial=partial,
                           head_before=head_before, reason=reason, unseen=unseen, agent=agent,
                           label=label, paths=paths)
        write_record(ws.records.drift_path(drift_no), drift, later)
        state["last_drift"] = drift_no
        return drift

    def newly_left_out(self, ws, snap):
        """What snap leaves out of the records that no save of the task has
        reported yet, as skipped_paths items: files whose content is never
        stored (sensitive names, files over 100 MB) first, then what a name
        rule leaves out. Nothing is left out silently: the first save names
        them all, later saves the ones newly met."""
        policy = self.policies.of(ws)
        now = {}
        for rel, entry in snap.entries.items():
            if entry.kind in (KIND_SENSITIVE, KIND_BIG):
                now[rel] = entry.kind
        for rel, folder in snap.left_out:
            now[rel] = "folder" if folder else "name"
        known = ws.records.read_left_out()
        new = sorted((rel for rel, kind in now.items() if known.get(rel) != kind),
                     key=lambda rel: (LEFT_OUT_ORDER.index(now[rel]), rel))
        if now != known:
            ws.records.write_left_out(now)
        return [{"path": rel, "reason": LEFT_OUT_REASONS.get(now[rel]) or policy.left_out_reason(
                     rel, folder=now[rel] == "folder")} for rel in new]

    def commit_snapshot(self, ws, state, snap, old_index, *, kind, partial=False, agent=None,
                        label=None):
        """The drift pipeline: when snap differs from the index's entries,
        its manifest and drift record, then the state that points at them,
        flushed together with the content they name; then the index. The
        drift record, or None when nothing changed. A failure before the
        state moved removes what was written (drop_unrecorded)."""
        old_entries = ws.records.index_entries(old_index)
        drift = None
        if snap.entries != old_entries:
            later = []
            counters = {key: state.get(key, 0) for key in RECORD_COUNTERS}
            try:
                drift = self.record_drift(ws, state, snap.entries,
                                          self.base_entries(old_entries, snap), kind=kind,
                                          partial=partial, later=later, unseen=snap.unseen,
                                          agent=agent, label=label)
                state["index_manifest"] = drift["manifest"]
                ws.records.write_state_with(
                    state, lambda staged: ws.store.payloads.flush_with(later + staged))
            except BaseException:
                self.drop_unrecorded(ws, counters, snap.created)
                raise
        self.write_index(ws, snap, old_index)
        return drift

    @staticmethod
    def drop_unrecorded(ws, counters, created):
        """After a save or capture failed before its state moved: remove the
        records it wrote and the content it stored, so no listing shows a
        step the caller was told failed, and a full disk gets its space back.
        counters: the state's record counters before the write. When the
        state did move, the write counts. When the cleanup itself fails, the
        store stays marked, and the next lock counts those records in
        (reconcile_numbers), as after a crash."""
        records = ws.records
        try:
            on_disk = records.read_state()
            if any(on_disk.get(key, 0) != value for key, value in counters.items()):
                return
            for key, (numbers, path_of) in records.numbered_records().items():
                for number in sorted(numbers, reverse=True):
                    if number > counters[key]:
                        remove_file(path_of(number))
        except (OSError, CheckpointError):
            ws.store.payloads.suspect = True
            return
        finally:
            records.manifests.forget()
        ws.store.payloads.discard(created)


# ---------------------------------------------------------------------------
# 15. Operations, one class each: a new feature of an operation lands in its class
# ---------------------------------------------------------------------------

# - - - 15.1 Task setup: tc_init, tc_switch -----------------------------------

class TaskSetup:
    """tc_init and tc_switch: making a task, choosing its store, making a
    task the active one."""

    def __init__(self, workspaces, recorder):
        self.workspaces = workspaces
        self.recorder = recorder
        self.config = workspaces.config

    def init(self, root, name, *, goal="", constraints="", store=None, exclude=None,
             agent=None):
        root = validate_root(root)
        refuse_pseudo_file_system(root)
        if not isinstance(name, str) or not name.strip():
            raise InvalidArgument("name must be a non-empty string")
        exclude = PathPolicy.check_patterns(exclude)
        with workspace_lock(root):
            self.workspaces.refuse_inside_another(root)
            moved = self._follow_moved_store(root)
            store_dir = self._init_store_dir(root, store)
            external = os.path.realpath(store_dir) != os.path.join(root, STORE_DIRNAME)
            st = self.workspaces.store(store_dir)
            ws = Workspace(root, st)
            (baseline, skipped), prev_suspended = self._init_task(
                ws, name, goal, constraints, exclude, external, agent)
        note = ("baseline recorded as %s (%d files); call tc_save after each finished step"
                % (baseline, len(ws.records.read_index()["files"])))
        if moved:
            note = moved + "; " + note
        if external:
            note += self._pointer_advice(ws)
        return {"task_id": ws.task_id, "name": ws.state["name"], "store": st.directory,
                "store_is_external": external, "prev_suspended": prev_suspended,
                "exclude": exclude, "note": note, "skipped_paths": skipped}, ws

    def _pointer_advice(self, ws):
        """For a store outside the workspace: what to do about the pointer
        file, which git lists as untracked unless its rules ignore it."""
        if not os.path.isfile(os.path.join(ws.root, POINTER_NAME)):
            return ""
        git = self.recorder.git_view(ws)
        if git is None or git.tracked.has(POINTER_NAME) or git.ignored(POINTER_NAME, False):
            return ""
        return ("; %s (where the store is) shows in git status as untracked: add it to "
                ".gitignore or .git/info/exclude to keep it out of commits" % POINTER_NAME)

    def _follow_moved_store(self, root):
        """Workspaces.adopt_moved_tasks for the store root uses; its note."""
        try:
            return self.workspaces.adopt_moved_tasks(
                root, self.workspaces.store(self.workspaces.store_dir_for(root)))
        except CheckpointError:  # a damaged pointer: the init replaces it
            return None

    def _init_task(self, ws, name, goal, constraints, exclude, external, agent):
        """Make the new task in ws.store and make it the workspace's active
        one; returns ((its baseline drift id, the skipped_paths of its
        scan), the task it suspended or None). agent: who starts it, kept in
        its state and on its baseline."""
        st, root = ws.store, ws.root
        with st.lock:
            ws.need_writable()
            task_id = st.new_task_id(name)
            ws.task_id = task_id
            ws.state = make_state(task_id=task_id, name=name.strip(), goal=goal or "",
                                  constraints=constraints or "", root=root, exclude=exclude,
                                  agent=agent)
            created = []  # content the baseline stored: nobody's if the init fails
            try:
                baseline = self._baseline(ws, created)
                ws.records.write_state(ws.state)
            except BaseException:
                remove_tree(ws.records.directory)
                ws.store.payloads.discard(created)
                raise
            # The new task is complete: only now is the previous one suspended.
            # A failure from here on (a read-only workspace refusing the
            # pointer, an unwritable current.json) undoes all of it.
            previous = st.read_current().get(root)
            pointer = os.path.join(root, POINTER_NAME)
            pointer_link = readlink_or_none(pointer)
            pointer_before = None if pointer_link else read_file_or_none(pointer)
            try:
                self._point_at_store(root, st, external)
                prev_suspended = st.make_active(root, task_id, previous)
            except BaseException:
                if pointer_link is None:
                    put_back_file(pointer, pointer_before, st.log)
                else:
                    put_back_link(pointer, pointer_link, st.log)
                remove_tree(ws.records.directory)
                ws.store.payloads.discard(created)
                raise
        return baseline, prev_suspended

    def _init_store_dir(self, root, store):
        """The store a tc_init uses: its store argument (checked, and only
        where TC_STORE does not name another), else TC_STORE, else the
        workspace's own. A workspace names one store: one that differs from
        the store holding the workspace's tasks is refused, since those
        tasks would be out of reach of every tool (no tc_switch back, no
        tc_resume)."""
        if store is not None and self.config.store and (
                os.path.realpath(store) != os.path.realpath(self.config.store)):
            raise InvalidArgument("TC_STORE is set to %r, so later calls would not find a task "
                                  "stored in %r; drop the store argument or change TC_STORE"
                                  % (self.config.store, store))
        chosen = (self.workspaces.store_dir_for(root) if store is None
                  else checked_store_path(root, store, "store"))
        try:
            own = self.workspaces.own_store_dir(root)
        except CheckpointError:  # a damaged pointer: the new one replaces it
            return chosen
        if os.path.realpath(own) != os.path.realpath(chosen):
            kept, damaged = tasks_kept_for(own, root)
            if kept:
                raise Conflict(self._left_behind_text(root, own, chosen, kept, damaged,
                                                      by_env=store is None))
        return chosen

    def _left_behind_text(self, root, own, chosen, kept, damaged, *, by_env):
        names = ", ".join(repr(t) + (" (damaged)" if t in damaged else "") for t in kept[:5])
        if len(kept) > 5:
            names += " and %d more" % (len(kept) - 5)
        several = len(kept) > 1
        text = ("this workspace's task%s %s %s kept in %r; a task in %r would put %s out of "
                "reach of every tool. " % ("s" if several else "", names,
                                           "are" if several else "is", own, chosen,
                                           "them" if several else "it"))
        text += ("Unset TC_STORE (or set it to that store)" if by_env
                 else "Leave out store") + " to add the new task there"
        # The ways out, all at once: the pointer file (read as own_store_dir
        # reads it), then the workspace's own .checkpoints when it holds this
        # workspace's tasks too (the store itself, or behind a link).
        pointer = os.path.join(root, POINTER_NAME)
        default = os.path.join(root, STORE_DIRNAME)
        ways = []
        if os.path.isfile(pointer) and not os.path.islink(pointer):
            ways.append("delete %r (it points the workspace at that store, which keeps "
                        "them)" % pointer)
        if not ways or (os.path.lexists(default) and tasks_kept_for(default, root)[0]):
            ways.append("move %r aside" % default)
        return text + ", or first %s if they are no longer wanted here" % " and ".join(ways)

    def _point_at_store(self, root, store, external):
        """Leave the pointer file an external store needs in the workspace (or
        remove a stale one). With TC_STORE set, later servers find the store
        without it, so a workspace that refuses the file (read-only) is fine."""
        pointer = os.path.join(root, POINTER_NAME)
        try:
            if external:
                wanted = {"store": store.directory}
                try:  # a link is never read as the pointer (own_store_dir): replaced
                    if not os.path.islink(pointer) and read_json(pointer) == wanted:
                        return
                except (OSError, StoreCorrupt):
                    pass
                write_json(pointer, wanted)
            elif os.path.isfile(pointer) and not os.path.islink(pointer):
                remove_file(pointer)  # the default store is back in use
        except OSError as exc:
            if not self.config.store:
                raise
            store.log("the store pointer %r could not be written (%s); TC_STORE names "
                      "the store" % (pointer, describe_os_error(exc)))

    def _baseline(self, ws, created):
        """Record the workspace as the task finds it, as drift d0001 (a new
        task has no stat cache, so every file is read); the content it
        stores is added to the list created. (Its id, what the
        scan passed over and what it left out: see Recorder.newly_left_out.)"""
        snap = self.recorder.snapshot(ws, store_content=True)
        created.extend(snap.created)
        drift = self.recorder.record_drift(ws, ws.state, snap.entries, {}, kind="baseline",
                                           unseen=snap.unseen, agent=ws.state.get("agent"))
        ws.state["index_manifest"] = drift["manifest"]
        ws.records.write_index({"stamp_ns": snap.stamp_ns, "files": snap.rows},
                               entries=snap.entries)
        return drift["id"], snap.skipped + self.recorder.newly_left_out(ws, snap)

    @staticmethod
    def switch(ws):
        """Make ws.task_id the active, open task of its workspace (under the lock)."""
        task_id = ws.task_id
        ws.need_writable()
        state = ws.records.read_state()
        if state["status"] == "closed":
            raise TaskClosed("task %r is closed; it can be read (tc_show, tc_resume) but "
                             "not reopened" % task_id)
        previous = ws.store.read_current().get(ws.root)
        reopened = state["status"] != "open"
        if reopened:
            state["status"] = "open"
            ws.records.write_state(state)
        try:
            ws.store.make_active(ws.root, task_id, previous)
        except BaseException:
            if reopened:
                try:
                    ws.store.suspend(task_id)
                except (OSError, CheckpointError):
                    pass  # open but not active: a save or switch sets it right
            raise
        return {"task_id": task_id, "status": "open"}


# - - - 15.2 Save and capture: tc_save, tc_capture ----------------------------

def find_groups(entries):
    """Top-level X.p3d expects the companion X.p3dat."""
    groups = []
    for path in sorted(entries):
        if "/" not in path and path.lower().endswith(".p3d"):
            companion = path + "at"
            groups.append({"main": path, "companion": companion,
                           "status": "ok" if companion in entries else "missing"})
    return groups


def head_moved(ws, state, expected_head):
    """The refusal of a save or restore based on expected_head when the
    task's head (state["head"]) is another step: one line naming the head,
    its title and who saved it, so that the caller knows what it missed."""
    head = state["head"]
    if head:
        try:
            step = ws.records.read_step(head)
            now = "step %d (%r)%s" % (head, step["title"][:200], by_agent(step))
        except (CheckpointError, OSError):
            now = "step %d (its record cannot be read)" % head
    else:
        now = "no step"
    based = "step %d" % expected_head if expected_head else "no step (0)"
    return Conflict("task %r has moved on: its head is %s, not %s as expected_head says; "
                    "nothing was written. Call tc_resume and decide again"
                    % (ws.task_id, now, based))


class Saving:
    """tc_save and tc_capture: a snapshot of the workspace becomes a step
    (with its git ref) or a drift record."""

    def __init__(self, recorder, git, log):
        self.recorder = recorder
        self.policies = recorder.policies
        self.git = git
        self.log = log

    @staticmethod
    def check_save(title, paths):
        """Refuse a save's arguments before anything is resolved."""
        if paths:
            raise InvalidArgument("paths must be empty: a save always records the whole "
                                  "workspace (use exclude on tc_init to leave files out)")
        if not isinstance(title, str) or not title.strip():
            raise InvalidArgument("title must be a non-empty string")

    def save(self, ws, title, *, description, conclusion, next_step, verified, open_questions,
             close, expected_head=None, agent=None):
        """Record the workspace as a new step of ws's task (under the lock).
        With expected_head, only when the task's head is that step (see
        _repeat_candidate); agent: who saves it, kept on the step and its drift.
        At MAX_STEP only close is accepted: it makes no step, and what changed
        goes into a drift record whose reason names the title."""
        ws.follow_active()
        ws.need_writable()
        current = ws.records.read_state()
        if current["status"] == "closed":
            raise TaskClosed("task %r is closed; it stays readable, start a new one with "
                             "tc_init" % ws.task_id)
        if current["last_step"] >= MAX_STEP and not close:
            raise Conflict("task %r has reached step %d, the highest number a step can "
                           "have; a tc_save with close: true closes it (what changed "
                           "goes into a drift record), and it stays readable; start a "
                           "new task with tc_init" % (ws.task_id, MAX_STEP))
        repeat = self._repeat_candidate(ws, current, expected_head)
        # The snapshot comes first: it is the last point where a cancel
        # stops the save, and nothing may be written before it.
        old_index = ws.records.read_index()
        snap = self.recorder.snapshot(ws, store_content=True)
        try:
            if repeat is not None and not self._same_step(
                    ws, repeat, title, conclusion, next_step, verified, None, snap, agent):
                raise head_moved(ws, current, expected_head)
            changed = ws.activate()
            state = ws.state = ws.records.read_state()
        except BaseException:
            ws.store.payloads.discard(snap.created)
            raise
        counters = {key: state.get(key, 0) for key in RECORD_COUNTERS}
        try:
            result = self._commit_step(ws, state, old_index, snap, title, description,
                                       conclusion, next_step, verified, open_questions, close,
                                       agent)
        except BaseException:
            self.recorder.drop_unrecorded(ws, counters, snap.created)
            raise
        result["skipped_paths"] = snap.skipped + self.recorder.newly_left_out(ws, snap)
        try:  # the files are recorded as they are now: a restore's read-back is history
            ws.records.clear_receipt()
        except OSError as exc:
            self.log("task %s: the receipt of the last restore stays (%s)"
                     % (ws.task_id, describe_os_error(exc)))
        # Inside the lock, so concurrent saves chain their refs in step order.
        step = result.pop("_step", None)
        result["git"] = self._save_git(ws, step, result)
        result["active_task_changed"] = changed
        return result

    @staticmethod
    def _repeat_candidate(ws, state, expected_head):
        """Before a save's snapshot: None when it may go on (no expected_head,
        or the task's head is that step). When the head is another step, the
        save is refused (head_moved), unless the head step was saved on
        expected_head: the save may then repeat it exactly (a call retried
        after its answer was lost), idempotent as without expected_head, and
        that step is returned for the snapshot to be compared with."""
        if expected_head is None or state["head"] == expected_head:
            return None
        head = ws.records.read_step(state["head"]) if state["head"] else None
        if head is None or head.get("head_before") != expected_head:
            raise head_moved(ws, state, expected_head)
        return head

    def _commit_step(self, ws, state, old_index, snap, title, description, conclusion,
                     next_step, verified, open_questions, close, agent):
        """The save pipeline after the snapshot (its payloads written):
        (drift) -> manifest -> step -> state -> index."""
        state_before = dict(state)
        old_entries = ws.records.index_entries(old_index)
        drift_id = None
        later = []  # records made durable together with the payloads, before the state
        # Only a close gets this far at the highest step number (see save): it
        # makes no step, so what changed always goes into a drift record.
        at_limit = state["last_step"] >= MAX_STEP
        if snap.entries != old_entries or not state.get("index_manifest"):
            if state.get("index_manifest") or at_limit:
                reason = ("closed at the highest step number, as %r" % title[:200]
                          if at_limit else None)
                drift_id = self.recorder.record_drift(
                    ws, state, snap.entries, self.recorder.base_entries(old_entries, snap),
                    kind="save", later=later, reason=reason, unseen=snap.unseen,
                    agent=agent)["id"]
            else:
                self.recorder.record_manifest(ws, state, snap.entries, later)
            state["index_manifest"] = state["last_manifest"]
        manifest_no = state["index_manifest"]
        head = ws.records.read_step(state["head"]) if state["head"] else None
        result = {"task_id": ws.task_id, "title": title, "groups": find_groups(snap.entries),
                  "skipped_paths": snap.skipped}
        if self._same_step(ws, head, title, conclusion, next_step, verified, manifest_no,
                           snap, agent):
            index, idempotent, new_step = head["index"], True, None
        elif at_limit:
            index, idempotent, new_step = state["head"], False, None
            result["title"] = head["title"] if head else title  # the step that stays the head
        else:
            index, idempotent = state["last_step"] + 1, False
            new_step = make_step(index=index, title=title, description=description,
                                 conclusion=conclusion, next_step=next_step, verified=verified,
                                 open_questions=open_questions, manifest=manifest_no,
                                 drift_id=drift_id, groups=result["groups"],
                                 unseen=snap.unseen, agent=agent, head_before=state["head"])
            write_record(ws.records.step_path(index), new_step, later)
            state["last_step"] = state["head"] = index
            state["head_manifest"] = manifest_no
        if close:
            state["status"] = "closed"
            state["closed"] = now_iso()
        if state != state_before:  # an idempotent save leaves the state file alone
            ws.records.write_state_with(
                state, lambda staged: ws.store.payloads.flush_with(later + staged))
        else:
            ws.store.payloads.flush_with(later)
        self.recorder.write_index(ws, snap, old_index)
        result.update({"index": index, "idempotent": idempotent, "closed": close,
                       "status": state["status"]})
        if new_step is not None:
            result["_step"] = (index, snap.entries, title)
        return result

    @staticmethod
    def _same_step(ws, head, title, conclusion, next_step, verified, manifest_no, snap, agent):
        """An idempotent save: same title, conclusion, next, verified and agent
        as the head step, the same unseen paths, and the same files (compared
        only when the rest matches; manifest_no None: by their entries)."""
        if head is None or (head.get("title"), head.get("conclusion"), head.get("next"),
                            head.get("verified"), head.get("unseen", []), head.get("agent")) != (
                                title, conclusion, next_step, verified, sorted(snap.unseen),
                                agent):
            return False
        return (head["manifest"] == manifest_no
                or ws.records.manifests.load(head["manifest"]) == snap.entries)

    # How many steps before a new one a save after a crash checks for refs.
    CATCH_UP_STEPS = 20

    def _save_git(self, ws, step, result):
        """The git result of a save: the new step's ref, or "no new step".
        After a writer died (Store.refs_unchecked), the task's next save
        also writes the refs that the steps before its new one (up to
        CATCH_UP_STEPS), or the head it repeats, lack: a dead writer may have
        been cut off between a step and its ref, more than once."""
        unchecked = ws.store.refs_unchecked() if self.git.enabled else set()
        after_crash = ws.task_id in unchecked
        try:
            if step is not None:
                return self._git_ref(ws, step, catch_up=after_crash)
            if after_crash and result["idempotent"]:
                try:
                    head = ws.records.read_step(result["index"])
                    entries = ws.records.manifests.load(head["manifest"])
                except (CheckpointError, OSError):
                    return self.git.skipped("no new step")
                made = self._git_ref(ws, (head["index"], entries, head["title"]), catch_up=True)
                if made["ok"]:
                    return made
            return self.git.skipped("no new step")
        finally:
            if after_crash:
                ws.store.set_refs_unchecked(ws.store.refs_unchecked() - {ws.task_id})

    def _git_ref(self, ws, step, *, catch_up=False):
        """The git result of writing a step's ref; with catch_up, the refs
        of the steps before it (CATCH_UP_STEPS at most) are written first
        where they have none."""
        index, entries, title = step

        def loader(number):
            def load():
                record = ws.records.read_step(number)
                return (ws.records.manifests.load(record["manifest"]),
                        step_message(ws.task_id, number, record["title"]))
            return load

        earlier = None
        if catch_up:
            earlier = [(number, loader(number)) for number in ws.records.step_numbers()
                       if index - self.CATCH_UP_STEPS <= number < index]
        try:
            return self.git.write_step_ref(
                root=ws.root, store_dir=ws.store.directory, task_id=ws.task_id,
                step_index=index, entries=entries, payload_path=ws.store.payloads.path,
                message=step_message(ws.task_id, index, title), earlier=earlier)
        except Exception as exc:  # git never fails a save
            self.log("git ref failed: %s" % traceback_text())
            return self.git.skipped("git failed", error=str(exc))

    @staticmethod
    def check_label(label):
        """Refuse a capture label that is not a short text, before anything is resolved."""
        if label is not None and (not isinstance(label, str) or len(label) > LABEL_LIMIT):
            raise InvalidArgument("label must be a text of at most %d characters"
                                  % LABEL_LIMIT)

    def capture(self, ws, *, source, partial, waiting, agent=None, label=None):
        """Record what changed since the last record as a drift record (under the lock)."""
        ws.follow_active()
        ws.need_writable()
        state = ws.state = ws.records.read_state()
        if state["status"] == "closed":
            raise TaskClosed("task %r is closed; nothing is recorded for it" % ws.task_id)
        old_index = ws.records.read_index()
        snap = self.recorder.snapshot(ws, store_content=True)
        drift = self.recorder.commit_snapshot(ws, state, snap, old_index, kind=source,
                                              partial=partial or waiting, agent=agent,
                                              label=label.strip() if label else None)
        return {"captured": drift is not None, "waiting": waiting,
                "drift_id": drift["id"] if drift else None,
                "partial": bool(drift and drift["partial"]), "reads": snap.reads,
                "skipped_paths": snap.skipped,
                "added": drift["added"] if drift else [],
                "modified": drift["modified"] if drift else [],
                "deleted": drift["deleted"] if drift else []}

    @gc_paused
    def unrecorded_signature(self, ws, store_dir, walked=None):
        """Stat-only description of unrecorded changes (empty when there are none),
        what the watcher compares between ticks: each file's size, mtime,
        ctime, inode and device against its index row. store_dir: the store the
        watcher found ws's task in (another store now: nothing to record).

        A dict passed as walked receives "records", the store files whose
        change would change the answer (active task, state, index), "dirs",
        the directories the walk went through (see scan_tree), and "ignored",
        a test (rel, name, is_dir) -> True for paths whose changes are none
        of this workspace's (excluded names, the store).
        """
        if walked is not None:
            walked["records"] = (ws.store.current_path, ws.records.state_path,
                                 ws.records.index_path, ws.records.index_log_path)
        if store_dir and ws.store.directory != store_dir:
            return ()
        if ws.state["status"] != "open":
            return ()
        rows = ws.records.read_index()["files"]
        git = self.recorder.git_view(ws)
        policy = self.policies.of(ws)
        seen = policy.seeing(git.tracked if git is not None else None)
        dirs = None
        if walked is not None:
            dirs = walked["dirs"] = []
            walked["ignored"] = lambda rel, name, is_dir: (
                (seen.excluded_folder(rel) if is_dir else seen.excluded(rel))
                or (git is not None and git.change_ignored(rel, name)))
            if git is not None:  # a git add, or an edit of the rules above the root
                walked["records"] += git.watched
        scan = scan_tree(ws.root, policy, dirs, git=git)
        files = scan.files
        # A file's signature: its path and the five stat fields (size to
        # dev) that StatInfo and IndexRow share, compared as a slice.
        changed = [(rel,) + info[:5] for rel, info in files.items()
                   if (row := rows.get(rel)) is None or row[:5] != info[:5]]
        if len(rows) + len(changed) > len(files):  # something recorded is gone
            changed.extend((rel,) for rel in gone_rows(scan, rows))
        return tuple(sorted(changed))


# - - - File diffs: what a step changed, what a restore would change -------------

DIFF_CONTEXT = 3  # lines of context around each change, as git shows them
PATCH_LINE_LIMIT = 400  # lines of one patch in a result; the rest is counted
DIFF_SIZE_LIMIT = 1 << 20  # a file over this many bytes gets no patch
PATCH_CUT_LINE = "\\ ... %d more lines of this patch left out\n"
_PATCH_CUT = re.compile(r"\\ \.\.\. ([0-9]+) more lines of this patch left out\n\Z")
NO_NEWLINE_LINE = "\\ No newline at end of file\n"
NO_CONTENT = "content not stored"

# Windows shows only a read-only flag as permission bits (0o444 or 0o666), so
# there a recorded mode is compared by its owner-write bit alone: a package
# made on Linux does not read as changed on every file.
MODE_BITS_COMPARED = 0o200 if WINDOWS else 0o7777


def diff_lines(data):
    """data as lines for a diff, each ending in "\n" but perhaps the last
    (lines end at "\n" only, as git splits them); None when data is not
    text: it holds a NUL byte or is not UTF-8."""
    if b"\x00" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.split("\n")
    last = lines.pop()
    out = [line + "\n" for line in lines]
    if last:
        out.append(last)
    return out


def patch_lines(patch):
    """A patch's lines, each with its "\n" (a patch line may hold a "\r")."""
    return [line + "\n" for line in patch.split("\n")[:-1]]


def cut_patch(patch, keep):
    """patch cut to its first keep lines, then one line saying how many
    were left out (counting those an earlier cut of it left out)."""
    earlier = _PATCH_CUT.search(patch)
    left = int(earlier.group(1)) if earlier else 0
    lines = patch_lines(patch[:earlier.start()] if earlier else patch)
    if len(lines) <= keep and not left:
        return patch
    left += max(0, len(lines) - keep)
    return "".join(lines[:keep]) + PATCH_CUT_LINE % left


def unified_patch(path, old_lines, new_lines):
    """(patch, lines added, lines removed): difflib's unified diff from
    old_lines (--- a/path) to new_lines (+++ b/path) with DIFF_CONTEXT lines
    of context. A last line without its newline is followed by git's
    "\\ No newline at end of file". Over PATCH_LINE_LIMIT lines the patch is
    cut (cut_patch); the counts are of the whole diff."""
    out = list(difflib.unified_diff(old_lines, new_lines, "a/" + path, "b/" + path,
                                    n=DIFF_CONTEXT))
    # Counted and joined by C loops: a patch of a long file has many lines.
    signs = collections.Counter(map(operator.itemgetter(0), out[2:]))  # after the file lines
    patch = "".join(out)
    if patch.count("\n") != len(out):  # a last line without its newline (at most two)
        out = [line if line.endswith("\n") else line + "\n" + NO_NEWLINE_LINE for line in out]
        patch = "".join(out)
    if patch.count("\n") > PATCH_LINE_LIMIT:
        patch = cut_patch(patch, PATCH_LINE_LIMIT)
    return patch, signs["+"], signs["-"]


def read_for_diff(path, *, within=None, missing=NO_CONTENT):
    """The bytes of the regular file path (read only inside within when
    given), or why there are none: missing when it is not there, "over 1 MB"
    when it grew past DIFF_SIZE_LIMIT, "unreadable: ..." otherwise."""
    try:
        fh, st = open_regular(path)
        with fh:
            if within is not None:
                opened_within(fh.fd, st, None, within, path)
            data = fh.read_all(min(st.st_size, DIFF_SIZE_LIMIT))
    except FileNotFoundError:
        return missing
    except OSError as exc:
        return "unreadable: %s" % describe_os_error(exc)
    return "over 1 MB" if len(data) > DIFF_SIZE_LIMIT else data


def change_entry(path, change, have, want, read_have, read_want):
    """One entry of a diff: {path, change, added, removed, patch, reason}.

    change: "write" (the file is new), "delete" or "replace"; have and want:
    the ManifestEntry before and after (None where there is no file);
    read_have and read_want: () -> the bytes of that side, or a str saying
    why there are none. Nothing is read for a sensitive file or one over
    DIFF_SIZE_LIMIT. A patch is null with reason "sensitive", "over 1 MB",
    "binary" or why the content is missing; a change of the mode alone has
    an empty patch and a reason saying so."""
    entry = {"path": path, "change": change, "added": None, "removed": None, "patch": None,
             "reason": None}
    sides = [e for e in (have, want) if e is not None]
    if any(e.kind == KIND_SENSITIVE for e in sides):
        entry["reason"] = "sensitive"
    elif any(e.kind == KIND_BIG or e.size > DIFF_SIZE_LIMIT for e in sides):
        entry["reason"] = "over 1 MB"
    else:
        old = read_have() if have is not None else b""
        new = read_want() if want is not None else b""
        unavailable = [side for side in (old, new) if isinstance(side, str)]
        if unavailable:
            entry["reason"] = unavailable[0]
        else:
            old_lines, new_lines = diff_lines(old), diff_lines(new)
            if old_lines is None or new_lines is None:
                entry["reason"] = "binary"
            else:
                entry["patch"], entry["added"], entry["removed"] = unified_patch(
                    path, old_lines, new_lines)
    if have is not None and want is not None and (have.mode ^ want.mode) & MODE_BITS_COMPARED:
        mode = "mode %o -> %o" % (have.mode, want.mode)
        if entry["patch"] == "":
            mode = "mode only: %o -> %o" % (have.mode, want.mode)
        entry["reason"] = mode if entry["reason"] is None else entry["reason"] + "; " + mode
    return entry


def records_diff(payloads, old, new):
    """The diff from one recorded file map to another (both from the store)."""
    added, modified, deleted = diff_maps(old, new)
    changes = [(rel, "write") for rel in added] + [(rel, "replace") for rel in modified] + [
        (rel, "delete") for rel in deleted]

    def stored(entry):
        return lambda: read_for_diff(payloads.path(entry.sha))

    return [change_entry(rel, change, old.get(rel), new.get(rel),
                         stored(old[rel]) if rel in old else None,
                         stored(new[rel]) if rel in new else None)
            for rel, change in sorted(changes)]


# - - - 15.3 Show and resume: tc_show, tc_resume ------------------------------

class Reporting:
    """tc_show and tc_resume: what the records say, and what changed on
    disk since (read-only)."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.policies = recorder.policies

    @staticmethod
    def check_show(index, diff):
        """Refuse a show's arguments before anything is resolved."""
        if diff and index is None:
            raise InvalidArgument("diff needs index: tc_show with index N and diff: true "
                                  "shows what step N changed against the step before it")

    def show(self, ws, *, index, include_drift, limit, cursor, diff=False):
        """A page of ws's steps (and drift records), or one step with its files
        (under the lock); with diff, also what that step changed."""
        ws.follow_active()
        state = ws.records.read_state()
        numbers = ws.records.step_numbers()
        changes = None
        if index is not None:
            ws.records.check_step_number(index, state["last_step"])
            step = ws.records.read_step(index)
            files = ws.records.manifests.load(step["manifest"])
            if diff:
                changes = records_diff(ws.store.payloads, self._before_step(ws, index), files)
            paths = sorted(files)[cursor:cursor + limit]
            steps = [self._step_view(step, state, files={p: files[p] for p in paths})]
            steps[0]["file_count"] = len(files)
            next_cursor = cursor + limit if cursor + limit < len(files) else None
            first = numbers.index(index) if index in numbers else len(numbers)
            span = (first, first + 1)
        else:
            page = numbers[cursor:cursor + limit]
            steps = [self._listed(lambda: self._step_view(ws.records.read_step(n), state),
                                  {"index": n, "head": n == state["head"]})
                     for n in page]
            next_cursor = cursor + limit if cursor + limit < len(numbers) else None
            span = (cursor, cursor + limit)
        drifts = []
        if include_drift:
            drift_numbers = self._drifts_of_steps(ws, numbers, *span)
            if not numbers:  # no step to belong to: the drift records come in pages
                drift_numbers = ws.records.drift_numbers()
                if cursor + limit < len(drift_numbers):
                    next_cursor = cursor + limit
                drift_numbers = drift_numbers[cursor:cursor + limit]
            drifts = [self._listed(lambda: self._drift_view(ws.records.read_drift(
                "d%04d" % n)), {"id": "d%04d" % n, "restorable": False}) for n in drift_numbers]
        result = {"task_id": ws.task_id, "status": state["status"], "head": state["head"],
                  "steps": steps, "drifts": drifts, "next_cursor": next_cursor,
                  "total_steps": len(numbers) if index is None else None}
        if changes is not None:
            result["diff"] = changes
        return result

    @staticmethod
    def steps_diff(ws, first, second):
        """What differs from step first to step second (any two steps, in
        either order: first is the "-" side), from the store alone (under
        the lock). For the command line's diff N M; tc_show's diff is a
        step against the one before it."""
        ws.follow_active()
        state = ws.records.read_state()
        maps = []
        for index in (first, second):
            ws.records.check_step_number(index, state["last_step"])
            maps.append(ws.records.manifests.load(ws.records.read_step(index)["manifest"]))
        return {"task_id": ws.task_id, "from": first, "to": second,
                "diff": records_diff(ws.store.payloads, *maps)}

    @staticmethod
    def _before_step(ws, index):
        """The files as they were before step index: the step before it, or
        for the first step the task's baseline (empty when it has none, as
        an imported task)."""
        if index > 1:
            return ws.records.manifests.load(ws.records.read_step(index - 1)["manifest"])
        try:
            baseline = ws.records.read_drift("d0001")
        except NotFound:
            return {}
        return (ws.records.manifests.load(baseline["manifest"])
                if baseline.get("kind") == "baseline" else {})

    def _drifts_of_steps(self, ws, numbers, first, end):
        """The numbers of the drift records that belong to the steps
        numbers[first:end]: each drift record belongs to the newest step
        made before it (those made before the first step, to the first),
        but the drift record a save made of its changes, just before its
        step, belongs to that step."""
        drifts = ws.records.drift_numbers()
        if not numbers or first >= len(numbers):
            return []
        begin_ns = self._created(ws.records.read_step, numbers[first]) if first > 0 else None
        end_ns = self._created(ws.records.read_step, numbers[end]) if end < len(numbers) else None

        def position(ns):  # of the first drift record made at or after ns
            low, high = 0, len(drifts)
            while low < high:
                middle = (low + high) // 2
                made = self._created(lambda n: ws.records.read_drift("d%04d" % n), drifts[middle])
                if made < ns:
                    low = middle + 1
                else:
                    high = middle
            return low

        start = 0 if begin_ns is None else position(begin_ns)
        stop = len(drifts) if end_ns is None else position(end_ns)
        own = {self._save_drift(ws, n) for n in numbers[first:end]} - {None}
        later = self._save_drift(ws, numbers[end]) if end < len(numbers) else None
        return sorted((set(drifts[start:stop]) - {later}) | (own & set(drifts)))

    @staticmethod
    def _save_drift(ws, number):
        """The number of the drift record step number's save made, or None."""
        try:
            drift_id = ws.records.read_step(number).get("drift_id")
        except (CheckpointError, OSError):
            return None
        return int(drift_id[1:]) if isinstance(drift_id, str) and DRIFT_ID.match(drift_id) else None

    @staticmethod
    def _created(read, number):
        """created_ns of a record (read(number)); -1 when it does not read."""
        try:
            made = read(number).get("created_ns")
        except (CheckpointError, OSError):
            return -1
        return made if isinstance(made, int) else -1

    @staticmethod
    def _listed(view, stub):
        """view() for a listing; a record that cannot be read is listed as
        stub with "damaged" saying why, so one bad record does not hide the
        others (showing or restoring it still fails with that reason)."""
        try:
            return view()
        except (StoreCorrupt, NotFound) as exc:  # NotFound: a dangling link by its name
            return dict(stub, damaged=str(exc))
        except OSError as exc:
            return dict(stub, damaged="cannot be read: %s" % describe_os_error(exc))

    @staticmethod
    def _step_view(step, state, files=None):
        view = {k: step.get(k) for k in ("index", "title", "description", "conclusion",
                                         "next", "verified", "open_questions", "created",
                                         "created_ns", "drift_id")}
        view["head"] = step["index"] == state["head"]
        with_agent(view, step.get("agent"))
        if files is not None:
            view["files"] = [{"path": p, "size": e.size, "mode": "%o" % e.mode,
                              "kind": {"f": "file", "s": "sensitive", "b": "large"}[e.kind],
                              "sha256": e.sha} for p, e in sorted(files.items())]
        return view

    @staticmethod
    def _drift_view(drift):
        view = {k: drift.get(k) for k in ("id", "kind", "created", "created_ns", "partial",
                                          "compressed", "added", "modified", "deleted",
                                          "head_before", "label")}
        view["restorable"] = not drift.get("compressed")
        return with_agent(view, drift.get("agent"))

    @gc_paused
    def resume(self, ws):
        """Read-only: where the task stands, and what changed since it was
        recorded. The records are read under the lock, the workspace is
        scanned after it."""
        errors = []
        with ws.store.lock:
            ws.follow_active(lenient=True)
            # The state as of the lock: a save or capture that held it while
            # this call waited has moved it, and the index read below with it.
            ws.load_state(lenient=True)
            active = ws.store.read_current().get(ws.root)
            if ws.state is None:
                return self._damaged_resume(ws, active)
            state = ws.state
            last = self._read_step_checked(ws, state["head"], errors)
            errors_before = len(errors)
            index_doc = self._read_index_checked(ws, errors)
            index_ok = len(errors) == errors_before
            errors.extend(self._health(ws, state))
            recorded = self._recorded_since_step(ws, state, index_doc if index_ok else None)
        unread, unseen = None, []
        try:
            scan = scan_tree(ws.root, self.policies.of(ws), git=self.recorder.git_view(ws))
            unseen = scan.unreadable
            drift_paths, skipped = self._readable_drift(
                ws, self._drift_paths(scan, index_doc), scan.skipped)
        except OSError as exc:  # the progress is still worth giving
            unread = exc.strerror or exc.__class__.__name__
            drift_paths, skipped = [], [{"path": ".", "reason": "unreadable directory: %s"
                                         % unread}]
        changed = sorted(set(recorded).union(drift_paths))
        last_view = {k: (last or {}).get(k, "") for k in ("title", "conclusion", "description",
                                                          "next", "agent")}
        last_view["verified"] = list((last or {}).get("verified") or [])
        next_step = last_view["next"]
        result = {"task_id": ws.task_id, "name": state["name"], "status": state["status"],
                  "goal": state["goal"], "constraints": state["constraints"],
                  "head": state["head"], "last": last_view,
                  "open_questions": (last or {}).get("open_questions", []),
                  "drift_paths": drift_paths, "next": next_step,
                  "changed_since_step": changed,
                  "health": {"ok": not errors, "errors": list(dict.fromkeys(errors))},
                  "store": ws.store.directory, "active_task": active, "skipped": skipped,
                  "recent": self._recent_steps(ws)}
        gone = frozenset(path for path in changed
                         if not os.path.lexists(os.path.join(ws.root, *path.split("/"))))
        result["handoff"] = handoff_text(state, last, drift_paths, changed, unread=unread,
                                         unseen=unseen, gone=gone)
        return result

    @staticmethod
    def _recent_steps(ws, count=5):
        """{index, title} of the task's newest steps, newest first, so a new
        session sees more than the last one."""
        recent = []
        for number in reversed(ws.records.step_numbers()[-count:]):
            try:
                recent.append({"index": number, "title": ws.records.read_step(number)["title"]})
            except (CheckpointError, OSError):
                recent.append({"index": number, "title": "(the record does not read)"})
        return recent

    def changed_since_step(self, ws, state):
        """Under the store lock, for an export: the paths whose files differ
        from what the package holds (the head step, else the latest record),
        the same list tc_resume gives as changed_since_step. Empty when the
        workspace cannot be read: the export does not depend on it."""
        errors = []
        index_doc = self._read_index_checked(ws, errors)
        try:
            drift_paths = self._readable_drift(
                ws, self._drift_paths(scan_tree(ws.root, self.policies.of(ws),
                                                git=self.recorder.git_view(ws)), index_doc),
                [])[0]
        except OSError:
            return []
        recorded = self._recorded_since_step(ws, state, None if errors else index_doc)
        return sorted(set(recorded).union(drift_paths))

    @staticmethod
    def _recorded_since_step(ws, state, index_doc):
        """The paths whose latest record differs from the head step: changes
        the watcher or tc_capture recorded that no step holds yet. The
        latest record is read from the index (index_doc, already in memory),
        or from the manifest the state names when the index cannot be read
        (index_doc None). An index left behind by a failed write can only
        miss changes that drift_paths, compared against the same index,
        then names. A file edited and changed back stays listed while the
        latest record holds the edit."""
        head_no, latest_no = state.get("head_manifest", 0), state.get("index_manifest", 0)
        if not state["head"] or not head_no or latest_no == head_no:
            return []
        try:
            step_entries = ws.records.manifests.load(head_no)
            if index_doc is not None:
                latest = ws.records.index_entries(index_doc)
            elif latest_no:
                latest = ws.records.manifests.load(latest_no)
            else:
                return []
        except CheckpointError:  # the head's manifest is among health.errors already
            return []
        added, modified, deleted = diff_maps(step_entries, latest)
        return added + modified + deleted

    def _damaged_resume(self, ws, active):
        """What resume can say when the task's state file cannot be read."""
        errors = self._health(ws, {}) or [
            "%r could not be read as a task state; it is damaged" % ws.records.state_path]
        empty = {"title": "", "conclusion": "", "description": "", "next": "", "agent": "",
                 "verified": []}
        return {"task_id": ws.task_id, "name": "", "status": "unknown", "goal": "",
                "constraints": "", "head": 0, "last": empty, "open_questions": [],
                "drift_paths": [], "changed_since_step": [], "next": "",
                "health": {"ok": False, "errors": errors}, "store": ws.store.directory,
                "active_task": active, "skipped": [], "recent": [],
                "handoff": "Task %s: its state file is damaged; see health.errors" % ws.task_id}

    @staticmethod
    def _read_step_checked(ws, index, errors):
        if not index:
            return None
        try:
            return ws.records.read_step(index)
        except CheckpointError as exc:
            errors.append(str(exc))
            return None

    def _read_index_checked(self, ws, errors):
        try:
            doc = ws.records.read_index()
        except OSError as exc:
            errors.append("cannot read %r: %s" % (ws.records.index_path, describe_os_error(exc)))
            return {"stamp_ns": 0, "files": {}}
        if ws.records.index_error:
            errors.append("%s (it is rebuilt by the next save)" % ws.records.index_error)
        return doc

    @staticmethod
    def _readable_drift(ws, paths, skipped):
        """paths without the files this process may not read, which no save
        can record either: they go to skipped (a new list) instead, so an
        unreadable file is not reported as unsaved work forever."""
        readable, skipped = [], list(skipped)
        for rel in paths:
            full = os.path.join(ws.root, *rel.split("/"))
            if os.path.lexists(full) and not os.access(full, os.R_OK):
                skipped.append({"path": rel, "reason": "unreadable: Permission denied"})
            else:
                readable.append(rel)
        return readable, skipped

    @staticmethod
    def _drift_paths(scan, index_doc):
        """The paths whose size or mtime differ from the index (new, changed
        or gone), but those the scan could not read and those git now
        ignores, which no save will record as gone. Size and mtime only: a
        rewrite that keeps both (cp -p, rsync -t, tar -x) is missing here,
        and a file edited and changed back can be listed."""
        rows = index_doc["files"]
        paths = [rel for rel, info in scan.files.items()
                 if rel not in rows or rows[rel].size != info.size
                 or rows[rel].mtime_ns != info.mtime_ns]
        paths.extend(gone_rows(scan, rows))
        return sorted(paths)

    def _health(self, ws, state):
        """Problems with the store itself: leftovers, unreadable records, lost content."""
        errors = []
        for dirpath, _dirs, names in os.walk(ws.records.directory):
            for name in names:
                if name.startswith(".tmp-"):
                    errors.append("leftover temporary file %r (an interrupted write, part of "
                                  "no record; safe to delete)" % os.path.join(dirpath, name))
        path = ws.records.state_path
        try:
            ws.records.read_state()  # parsed and checked field by field
        except NotFound:
            errors.append("%r is missing" % path)
        except StoreCorrupt as exc:
            errors.append(str(exc))
        except OSError as exc:
            errors.append("cannot read %r: %s" % (path, describe_os_error(exc)))
        if ws.store.journal_dirs():
            blocker = ws.store.rollback_blocker()
            errors.append("an interrupted restore or import is pending; it is rolled back "
                          "by the next tool call that writes" + (": " + blocker if blocker
                                                                 else ""))
        if state.get("head"):
            errors.extend(self._missing_content(ws, state))
        errors.extend(self._over_budget(ws))
        receipt = ws.records.read_receipt()
        if receipt is not None:
            first = (receipt["mismatched"] or [{"path": "?", "reason": "not recorded"}])[0]
            errors.append("the restore recorded as %s left %s file(s) not as it wrote them, "
                          "e.g. %r (%s); look at them, then tc_save (which ends this notice)"
                          % (receipt.get("recovered"), receipt.get("count", 1),
                             first.get("path"), first.get("reason")))
        return errors

    def _over_budget(self, ws):
        """The store's budget cannot be kept: what a budget never reclaims
        needs more by itself (found by the last budget pass)."""
        budget = self.recorder.config.store_budget
        note = ws.store.budget_note() if budget else {}
        if not note.get("over") or note.get("budget") != budget:
            return []
        return ["the store holds %s bytes, over TC_STORE_BUDGET (%d bytes), and its steps, "
                "recovered records and newest %d drift records of each task need %s by "
                "themselves, so no more was reclaimed; raise the budget, or continue in a "
                "new store" % (note.get("total_bytes"), budget, BUDGET_KEEPS_NEWEST,
                               note.get("kept_bytes"))]

    def _missing_content(self, ws, state):
        try:
            step = ws.records.read_step(state["head"])
            entries = ws.records.manifests.load(step["manifest"])
        except CheckpointError as exc:
            return [str(exc)]
        lost = set(ws.store.payloads.missing({e.sha for e in entries.values()
                                              if e.kind == KIND_FILE}, reuse_listings=True))
        missing = [p for p, e in entries.items() if e.kind == KIND_FILE and e.sha in lost]
        if missing:
            return ["content of %d file(s) of step %d is missing from the store, e.g. %r"
                    % (len(missing), state["head"], sorted(missing)[0])]
        return []


# - - - 15.4 Restore: the planner, then tc_restore ----------------------------

def same_content(have, want):
    if have.kind != want.kind:
        return False
    if have.kind == KIND_SENSITIVE:
        return have.size == want.size and have.mtime_ns == want.mtime_ns
    return have.sha == want.sha and not (have.mode ^ want.mode) & MODE_BITS_COMPARED


def plan_restore(target, current, has_payload, *, skipped=(), unseen=(), policy=None,
                 within=None, ignored=None, ignored_after=None, ignored_paths=()):
    """What a restore to target changes in a workspace whose state is current.

    skipped: paths the scan passed over (unreadable, symlinks, special
    files); they are never touched, and neither is a path the workspace's
    policy excludes. unseen: the same kind of items for the paths the target
    record could not read when it was made; a file there is neither deleted
    nor overwritten, but a missing one is written. With OLDER_NAMES among
    them (older_names), a file the record's older name rules left out is
    not deleted either. ignored(path): True for a path git ignores in this workspace,
    which is never written (nor deleted: no scan lists it); ignored_after(path):
    True for a path git ignores under the target's own .gitignore files,
    which is not deleted either (it is an ignored file once they are back);
    ignored_paths: what the scan left out as git ignores it (folders with a
    trailing "/"), which stands in the way of a file to be written there. within (a PathScope): only its paths are planned; the other
    files of current still stand in the way of what would be written.
    Preview and apply compute the same plan.

    Permission bits are restored, so a file whose content matches but whose
    bits differ is in to_replace (same_content); mtimes are not, since old
    time stamps would make make-like tools skip a rebuild. A sensitive file
    or one over 100 MB in the workspace is never deleted or overwritten.
    """
    plan = {"to_delete": [], "to_write": [], "to_replace": [], "unrestorable": []}
    untouchable = {item["path"]: item["reason"] for item in skipped}
    not_seen = {item["path"]: item["reason"] for item in unseen}
    older = None if policy is None else next(
        (item["names"] for item in unseen if item["path"] == "" and "names" in item), None)
    # Within a scope, a file under a planned path is planned too: the files
    # outside it matter only where they stand on a planned path's way.
    planned = current if within is None else {p: e for p, e in current.items() if p in within}
    wanted = target if within is None else {p: e for p, e in target.items() if p in within}
    for path, have in sorted(planned.items()):
        if path in target:
            continue
        left = _left_in_place(path, untouchable) or _left_in_place(path, not_seen)
        if left:  # known only from an earlier record: never deleted unseen
            plan["unrestorable"].append({"path": path, "reason": left})
        elif older is not None and policy.left_out_before(path, older):
            plan["unrestorable"].append({"path": path, "reason": OLDER_NAMES_REASON})
        elif ignored_after is not None and ignored_after(path):
            plan["unrestorable"].append({"path": path, "reason": "git ignores it under that "
                                         "record's .gitignore rules: left as it is"})
        elif have.kind == KIND_SENSITIVE:
            plan["unrestorable"].append({"path": path, "reason": "sensitive file: never deleted"})
        elif have.kind == KIND_BIG:
            plan["unrestorable"].append({"path": path, "reason": "over 100 MB, no stored copy: "
                                         "not deleted"})
        else:
            plan["to_delete"].append(path)
    deleted = set(plan["to_delete"])
    left_alone = [p.rstrip("/") for p in ignored_paths]
    kept_dirs = (ancestors([p for p in planned if p not in deleted] + list(untouchable)
                           + left_alone)
                 | {p.rstrip("/") for p in ignored_paths if p.endswith("/")})
    for path, want in sorted(wanted.items()):
        have = current.get(path)
        if have is not None and same_content(have, want):
            continue
        reason = (_untouchable_reason(path, untouchable, kept_dirs, policy, ignored)
                  or (have is not None and _left_in_place(path, not_seen))
                  or _unrestorable_reason(path, have, want, has_payload, current, deleted))
        if reason:
            plan["unrestorable"].append({"path": path, "reason": reason})
        else:
            plan["to_replace" if have is not None else "to_write"].append(path)
    return plan


IN_THE_WAY_TEXT = ("a file left as it is, or made while the restore ran, stands where one "
                   "of its folders must go (or inside the folder that must give way to it); "
                   "left as it is")
FOLDER_IN_THE_WAY_TEXT = ("a folder with something in it stands there (what no scan listed: "
                          "an excluded or empty folder, or files made meanwhile); move it away "
                          "and restore again")


def in_the_way(rel, left):
    """Whether a path in left (left as it is by an operation) stands where
    writing rel needs room: at one of rel's folders, or inside a folder at
    rel that would have to give way to the file."""
    parts = rel.split("/")
    if any("/".join(parts[:n]) in left for n in range(1, len(parts))):
        return True
    inside = rel + "/"
    return any(path.startswith(inside) for path in left)


def plan_without(plan, left):
    """The plan less the paths in left (those an operation left as they
    were); its unrestorable items stay."""
    if not left:
        return plan
    left = set(left)
    return {key: [rel for rel in value if rel not in left] if key != "unrestorable" else value
            for key, value in plan.items()}


def ancestors(paths):
    """Every directory that is a parent of one of paths."""
    out = set()
    for path in paths:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            out.add("/".join(parts[:depth]))
    return out


def _untouchable_reason(path, untouchable, kept_dirs, policy, ignored=None):
    if policy is not None and (policy.excluded(path) or policy.sensitive(path)):
        return "excluded or sensitive in this workspace: never written"
    if ignored is not None and ignored(path):
        return "git ignores it in this workspace: never written"
    left = _left_in_place(path, untouchable)
    if left:
        return left
    if path in kept_dirs:
        return "a directory with files that stay is in the way"
    return None


def _left_in_place(path, untouchable):
    """Why a scan left path (or a folder above it) alone, or None."""
    if not untouchable:
        return None
    if path in untouchable:
        return "left in place: %s" % untouchable[path]
    parts = path.split("/")
    for depth in range(1, len(parts)):
        prefix = "/".join(parts[:depth])
        if prefix in untouchable:
            return "left in place: %r is %s" % (prefix, untouchable[prefix])
    return None


def _unrestorable_reason(path, have, want, has_payload, current, deleted):
    if want.kind == KIND_SENSITIVE:
        return "sensitive file: its content is never stored"
    if want.kind == KIND_BIG:
        return "over 100 MB: its content is not stored"
    if have is not None and have.kind == KIND_SENSITIVE:
        return "sensitive file in the workspace: never overwritten"
    if have is not None and have.kind == KIND_BIG:
        return "over 100 MB in the workspace, no stored copy: not overwritten"
    if not has_payload(want.sha):
        return "stored content is missing (reclaimed or lost)"
    parts = path.split("/")
    for depth in range(1, len(parts)):
        prefix = "/".join(parts[:depth])
        if prefix in current and prefix not in deleted:
            return "blocked by the file %r that stays in place" % prefix
    return None


PLAN_ID = re.compile(r"^[0-9a-f]{64}\Z")
PREVIEWS_KEPT = 16  # previews whose plans an apply can compare with (in memory)
VOIDED_TEXT_LIMIT = 300  # characters of a voided step's conclusion in a result
NOTE_NAMES = 5  # steps or paths a note names; the rest it counts
RECEIPT_KEPT = 20  # mismatches of a read-back kept for tc_resume (with their count)


def entry_state(entry):
    """What a plan id holds of a file: its kind, content (size and mtime for
    a sensitive file, which is never read) and mode; None for no file."""
    if entry is None:
        return None
    content = [entry.size, entry.mtime_ns] if entry.kind == KIND_SENSITIVE else entry.sha
    return [entry.kind, content, entry.mode]


def plan_states(plan, current, target):
    """{path: state} of every path of a plan: the file now and in the target
    (entry_state) for what it changes, the reason for what it leaves."""
    states = {}
    for key in ("to_delete", "to_write", "to_replace"):
        for rel in plan[key]:
            states[rel] = [entry_state(current.get(rel)), entry_state(target.get(rel))]
    for item in plan["unrestorable"]:
        states[item["path"]] = ["left", item["reason"]]
    return states


def plan_digest(identity, states):
    """The plan id: a sha256 of a canonical JSON of the restore (identity)
    and the states of its paths. A preview and an apply of the same
    restore in the same state compute the same id."""
    text = json.dumps({"restore": identity, "files": states}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def clipped(text, limit):
    return text if len(text) <= limit else text[:limit] + "..."


def named_list(items, shown=NOTE_NAMES):
    """items joined for a sentence, the ones past shown counted."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (" and %d more" % more if more > 0 else "")


def target_text(index, record):
    """How a note names the record a restore goes to."""
    if index is not None:
        return 'step %d ("%s")' % (index, clipped(shown_path(record.get("title", "")), 80))
    if record.get("kind") == "recovered":
        return "drift record %s (the workspace as it was before an earlier restore)" % record["id"]
    if record.get("label"):
        return 'drift record %s ("%s")' % (record["id"],
                                           clipped(shown_path(record["label"]), 80))
    return "drift record %s" % record["id"]


def restore_note(*, applied, what, task, into, scope, plan, voided, recovered, advice,
                 mismatched):
    """A few plain lines for the conversation: what was restored, which
    steps no longer describe the files on disk, how to undo it."""
    changed = len(plan["to_delete"]) + len(plan["to_write"]) + len(plan["to_replace"])
    only = ""
    if scope is not None:
        only = " for %s only (every other file as it is)" % named_list(
            [shown_path(p) for p in scope.paths])
    if applied:
        lines = ["Restored the workspace to %s of task %s%s: %d file(s) changed."
                 % (what, task, only, changed)]
    else:
        lines = ["Preview (nothing changed yet): restoring the workspace to %s of task %s%s "
                 "would change %d file(s)." % (what, task, only, changed)]
    if voided:
        steps = named_list(['%d ("%s")' % (v["index"], clipped(shown_path(v["title"]), 60))
                            for v in voided])
        lines.append("%s steps %s: their conclusions no longer describe the files on disk."
                     % ("Undone:" if applied else "It would undo", steps))
    if plan["unrestorable"]:
        lines.append("%d file(s) %s left as they are (plan.unrestorable says why)."
                     % (len(plan["unrestorable"]), "were" if applied else "would be"))
    if mismatched:
        lines.append("%d file(s) did not read back as restored (receipt.mismatched); look at "
                     "them before going on." % mismatched)
    if applied:
        lines.append('To undo this restore: tc_restore with drift_id "%s" (%spreview first).'
                     % (recovered, "" if into == task else "a record of the active task %s; "
                        % into))
    elif advice:
        lines.append(advice)
    return "\n".join(lines)


def written_as(ws, rel, want):
    """None when the workspace file rel reads back as the entry want (its
    content hash and mode), else why not."""
    full = os.path.join(ws.root, *rel.split("/"))
    try:
        st = os.lstat(full)
        if not stat_mod.S_ISREG(st.st_mode):
            return "not a regular file after the restore wrote it"
        sha = hash_file(full, within=ws.guard)[0]
    except FileNotFoundError:
        return "gone after the restore wrote it"
    except OSError as exc:
        return "cannot be read back: %s" % describe_os_error(exc)
    if sha != want.sha:
        return ("not the content the restore wrote (another program wrote it meanwhile, or "
                "the disk gave back other bytes)")
    if (stat_mod.S_IMODE(st.st_mode) ^ want.mode) & MODE_BITS_COMPARED:
        return "mode %o, not the %o it was restored with" % (stat_mod.S_IMODE(st.st_mode),
                                                              want.mode)
    return None


def deleted_as(ws, rel):
    """None when no file stands at rel, which a restore deleted (a folder
    may: the target's files under it), else why not."""
    try:
        st = os.lstat(os.path.join(ws.root, *rel.split("/")))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return "cannot be looked for after the restore deleted it: %s" % describe_os_error(exc)
    if stat_mod.S_ISDIR(st.st_mode):
        return None
    return "there again after the restore deleted it (another program made it meanwhile)"


class Restoring:
    """tc_restore: plan (plan_restore, above), bind it to an id, secure the
    undo content, journal, write, read back, record what undoes it.

    The task whose record is restored (the source) and the task that
    records the restore (into: the workspace's active task, which must be
    open to apply) are the same unless task_id names another task of the
    workspace: then its files are written into the workspace, the record
    that undoes it goes into the active task, and the named task and the
    active task's head stay as they are."""

    def __init__(self, recorder, log):
        self.recorder = recorder
        self.policies = recorder.policies
        self.log = log
        # The plans of the latest previews by plan id, in this process only
        # (a preview writes nothing): an apply whose plan_id is among them
        # names the paths that changed since.
        self._previews = collections.OrderedDict()
        self._previews_lock = threading.Lock()

    @staticmethod
    def check_target(index, drift_id):
        """Refuse a restore's target arguments before anything is resolved."""
        if (index is None) == (drift_id is None):
            raise InvalidArgument("pass exactly one of index (a step number) or drift_id "
                                  "(a drift record such as 'd0003')")
        if drift_id is not None:
            validate_drift_id(drift_id)

    @staticmethod
    def check_options(paths, plan_id):
        """paths in normal form (None when not given), after refusing a bad
        path or plan_id before anything is resolved."""
        if plan_id is not None and (not isinstance(plan_id, str) or not PLAN_ID.match(plan_id)):
            raise InvalidArgument("plan_id %r is not a plan id: pass the 64 hex digits a "
                                  "preview (apply: false) returned as plan_id"
                                  % (plan_id if not isinstance(plan_id, str) else plan_id[:80],))
        if paths is None:
            return None
        if not isinstance(paths, (list, tuple)) or not paths:
            raise InvalidArgument("paths must name at least one file or folder; leave it out "
                                  "to restore every file")
        out = []
        for item in paths:
            if isinstance(item, str) and len(item) > 1 and item.endswith("/"):
                item = item[:-1]  # "docs/" names the folder docs
            try:
                out.append(normalize_rel(item))
            except UnsafePath as exc:
                raise InvalidArgument("paths: %s; name files and folders relative to the "
                                      "workspace root, such as 'src/app.py' or 'docs'; "
                                      "nothing was restored" % exc) from None
        return out

    @staticmethod
    def named_task(workspaces, root, task_id):
        """The Workspace of the task a restore names (resolve), with what to
        do when the task does not exist."""
        try:
            return workspaces.resolve(root, task_id)
        except NotFound as exc:
            if task_id is None:
                raise
            raise NotFound("%s; pass task_id of one of this workspace's tasks (tc_init "
                           "returned it, tc_resume names the active one), or leave it out "
                           "to restore the active task" % exc) from None

    def restore(self, ws, *, index, drift_id, apply, named=False, paths=None, diff=False,
                plan_id=None, expected_head=None, agent=None):
        """Preview, or with apply do, a restore of the workspace to a step or
        a drift record of ws's task (under the lock). named: task_id named
        ws's task (see the class). paths: only those files and folders
        (normal form); diff: add what each planned file changes; plan_id:
        refuse an apply whose plan is no longer the one of that id;
        expected_head: refuse an apply unless the head of the task it is
        recorded in is that step; agent: who restores, kept on the
        recovered record."""
        source, into = self._tasks(ws, named)
        if apply:
            self._check_apply(source, into)
            if expected_head is not None and into.state["head"] != expected_head:
                raise head_moved(into, into.state, expected_head)
        base = into or source  # whose index and rules the workspace is read with
        same = into is source
        target_no, record, unseen = self._restore_target(source, index, drift_id)
        scope = self._scope(base, record, paths)
        target = source.records.manifests.load(target_no)
        identity = {"task": source.task_id, "target": self._target_name(index, drift_id),
                    "manifest": target_no, "paths": list(scope.paths) if scope else None,
                    "head": base.state["head"] if same and self._open(base) else None}
        snap, plan, computed = self._bound_plan(base, source, target, record, index, unseen,
                                                scope, identity, apply=apply, plan_id=plan_id,
                                                check_named=paths is not None)
        changes = self._diff(base, plan, snap.entries, target) if diff else None
        head_after = self._head_after(base, same, scope, index, record)
        voided = (self._voided(source, index, base.state["head"])
                  if same and scope is None and index is not None and self._open(base) else [])
        recovered, skipped, receipt, done = None, snap.skipped, None, plan
        if apply:
            snap, plan = self._secure_undo(base, snap, plan, target, unseen, scope)
            if plan is not done:  # planned again: the id of the plan it carries out
                computed = plan_digest(identity, plan_states(plan, snap.entries, target))
            recovered, left = self._apply_restore(into, into.state, target, target_no, snap,
                                                  plan, head_after, same=same, scope=scope,
                                                  agent=agent)
            skipped = skipped + left
            done = plan_without(plan, [item["path"] for item in left])
            with cancellable(None):  # done and recorded: a cancel now would only mislead
                receipt = self._receipt(into, target, done, recovered)
        note = restore_note(
            applied=bool(apply), what=target_text(index, record), task=source.task_id,
            into=base.task_id, scope=scope, plan=done, voided=voided, recovered=recovered,
            advice=None if apply else self._preview_advice(source, into, index, drift_id),
            mismatched=len(receipt["mismatched"]) if receipt else 0)
        result = {"applied": bool(apply), "recovered": recovered,
                  "plan": {k: plan[k] for k in ("to_delete", "to_write", "to_replace",
                                                "unrestorable")},
                  "skipped_paths": skipped, "head": head_after if apply else base.state["head"],
                  "target": identity["target"], "plan_id": computed, "receipt": receipt,
                  "voided": voided, "note": note}
        if changes is not None:
            result["diff"] = changes
        return result

    @staticmethod
    def _ignore_tests(snap, target, payloads):
        """plan_restore's ignored and ignored_after for a restore to target
        (a record's files) of a workspace as snap found it."""
        if snap.git is None:
            return {"ignored": None, "ignored_after": None}
        after = snap.git.recorded(target, payloads)
        return {"ignored": snap.git.ignored, "ignored_after": after.ignored,
                "ignored_paths": snap.git.ignored_paths}

    def _seen_policy(self, ws, snap):
        """ws's policy as the snapshot's scan applied it: with git's tracked
        paths in a git work tree (PathPolicy.seeing)."""
        return self.policies.of(ws).seeing(snap.git.tracked if snap.git else None)

    def _bound_plan(self, base, source, target, record, index, unseen, scope, identity, *,
                    apply, plan_id, check_named):
        """(snapshot, plan, plan id) of a restore to target, read as base's
        workspace; an apply whose plan_id differs, or (check_named) a path
        given that names nothing, is refused here, before anything is
        written (what the snapshot stored is removed again)."""
        snap = self.recorder.snapshot(base, store_content=apply, strict=True, within=scope)
        try:
            if check_named:
                self._check_named(scope, target, snap, record, index, source)
            plan = plan_restore(target, snap.entries, base.store.payloads.has,
                                skipped=snap.skipped, unseen=unseen,
                                policy=self._seen_policy(base, snap), within=scope,
                                **self._ignore_tests(snap, target, base.store.payloads))
            states = plan_states(plan, snap.entries, target)
            computed = plan_digest(identity, states)
            if apply and plan_id is not None and plan_id != computed:
                raise self._plan_changed(plan_id, identity, states)
        except BaseException:
            base.store.payloads.discard(snap.created)  # nothing records them yet
            raise
        if not apply:
            self._remember(computed, identity, states)
        return snap, plan, computed

    @staticmethod
    def _tasks(ws, named):
        """(source, into) of a restore (see the class); into is None when
        the workspace has no active task."""
        if not named:
            ws.follow_active()
            ws.state = ws.records.read_state()
            return ws, ws
        ws.state = ws.records.read_state()
        active = ws.store.read_current().get(ws.root)
        if active is None:
            return ws, None
        if active == ws.task_id:
            return ws, ws
        return ws, Workspace(ws.root, ws.store, active).load_state()

    @staticmethod
    def _open(ws):
        return ws.state["status"] != "closed"

    @staticmethod
    def _target_name(index, drift_id):
        return ("s%04d" % index) if index is not None else drift_id

    @staticmethod
    def _check_apply(source, into):
        """Refuse an apply that no open task can record."""
        if into is None:
            raise NotFound("no task is open in %r, and a restore is recorded in the open task "
                           "so that it can be undone: start a task with tc_init, then call "
                           "tc_restore with task_id %r and apply: true"
                           % (source.root, source.task_id))
        into.need_writable()
        if into.state["status"] != "closed":
            return
        if into is source:
            raise TaskClosed("task %r is closed and stays as it is: its restore can be "
                             "previewed (apply: false) but not applied to it. To bring its "
                             "files back, start a task with tc_init, then call tc_restore "
                             "with task_id %r and apply: true: the files are written and the "
                             "record that undoes it goes into the new task"
                             % (source.task_id, source.task_id))
        raise TaskClosed("the workspace's active task %r is closed, and a restore is recorded "
                         "in the open task: start a task with tc_init, then call tc_restore "
                         "with task_id %r and apply: true" % (into.task_id, source.task_id))

    def _preview_advice(self, source, into, index, drift_id):
        """The line of a preview's note that says how an apply can go."""
        target = "index: %d" % index if index is not None else 'drift_id: "%s"' % drift_id
        if into is None or not self._open(into):
            closed = "" if self._open(source) else "Task %s is closed and stays as it is: " % (
                source.task_id)
            return ('%san apply must go through an open task: start one with tc_init, then '
                    'tc_restore with task_id "%s", %s and apply: true.'
                    % (closed, source.task_id, target))
        if into is not source:
            return ("Applying writes these files into the workspace and records the undo in "
                    "the open task %s; task %s stays as it is." % (into.task_id, source.task_id))
        return None

    @staticmethod
    def _restore_target(source, index, drift_id):
        """(manifest number, record, unseen items) of the record restored."""
        if index is not None:
            source.records.check_step_number(index, source.state["last_step"])
            step = source.records.read_step(index)
            return step["manifest"], step, unseen_skips(step)
        drift = source.records.read_drift(drift_id)
        if drift.get("compressed"):
            raise InvalidArgument("drift %r was reclaimed by tc_compress and can no longer be "
                                  "restored; pick a step or a newer drift" % drift_id)
        return drift["manifest"], drift, unseen_skips(drift)

    @staticmethod
    def _head_after(base, same, scope, index, record):
        """The head of the recording task after the restore: only a whole
        restore of its own records moves it."""
        head = base.state["head"]
        if not same or scope is not None:
            return head
        if index is not None:
            return index
        if record.get("kind") == "recovered" and record.get("head_before") is not None:
            return record["head_before"]
        return head

    def _scope(self, base, record, paths):
        """The PathScope of a restore, or None for the whole workspace. A
        record that undoes a restore of some paths restores only those;
        paths given must then lie within them. A path in the store, or one
        the workspace's rules leave out, is refused."""
        kept = record.get("paths")
        if paths is None:
            return None if kept is None else PathScope(kept)
        git = self.recorder.git_view(base)
        policy = self.policies.of(base).seeing(git.tracked if git is not None else None)
        for rel in paths:
            store_rel = policy.store_rel
            if store_rel and (rel == store_rel or rel.startswith(store_rel + "/")):
                raise InvalidArgument("paths: %r is inside the checkpoint store, which is never "
                                      "restored; nothing was restored" % rel)
            folder = os.path.isdir(os.path.join(base.root, *rel.split("/")))
            if policy.excluded_folder(rel) if folder else policy.excluded(rel):
                raise InvalidArgument("paths: %r is left out of every scan in this workspace "
                                      "(an always-excluded name or the task's exclude), so "
                                      "nothing of it is stored or restored; nothing was "
                                      "restored" % rel)
            if git is not None and git.ignored(rel, folder):
                raise InvalidArgument("paths: %r is ignored by git in this workspace (its "
                                      ".gitignore rules), so checkpoints leave it out and "
                                      "nothing of it is stored or restored; nothing was "
                                      "restored" % rel)
            if policy.sensitive(rel):
                raise InvalidArgument("paths: %r is a sensitive name, whose content is never "
                                      "stored, so it cannot be restored; nothing was restored"
                                      % rel)
        if kept is None:
            return PathScope(paths)
        allowed, narrowed = PathScope(kept), []
        for rel in paths:
            inner = [rel] if allowed.covering(rel) else [p for p in kept
                                                         if p.startswith(rel + "/")]
            if not inner:
                raise InvalidArgument("paths: %r is not among the paths drift %s holds (it "
                                      "undoes a restore of %s only); name paths within them, "
                                      "or leave paths out" % (rel, record["id"],
                                                              named_list(list(kept))))
            narrowed.extend(inner)
        return PathScope(narrowed)

    @staticmethod
    def _check_named(scope, target, snap, record, index, source):
        """Refuse a path of scope that names nothing in the target and
        nothing in the workspace (a typo must not restore nothing)."""
        found = set()
        for rel in itertools.chain(target, snap.entries, (i["path"] for i in snap.skipped)):
            if rel in scope:
                found.update(scope.covering(rel))
        unknown = [rel for rel in scope.paths if rel not in found]
        if unknown:
            where = ("step %d" % index) if index is not None else "drift %s" % record["id"]
            raise NotFound("paths: %s %s nothing in %s of task %s nor in the workspace; check "
                           "the spelling (tc_show with index lists a step's files); nothing "
                           "was restored" % (named_list([repr(p) for p in unknown]),
                                             "names" if len(unknown) == 1 else "name", where,
                                             source.task_id))

    def _remember(self, plan_id, identity, states):
        with self._previews_lock:
            self._previews[plan_id] = (identity, states)
            self._previews.move_to_end(plan_id)
            while len(self._previews) > PREVIEWS_KEPT:
                self._previews.popitem(last=False)

    def _plan_changed(self, plan_id, identity, states):
        """The refusal of an apply whose plan_id is not its plan now, naming
        what changed when this process made that preview."""
        with self._previews_lock:
            before = self._previews.get(plan_id)
        if before is None:
            what = ("the workspace or the task changed since that preview (or another server "
                    "made it)")
        elif before[0] != identity:
            then = before[0]
            if (then["task"], then["target"], then["paths"]) != (
                    identity["task"], identity["target"], identity["paths"]):
                what = "that preview was of another restore (%s of task %s%s)" % (
                    then["target"], then["task"],
                    " for %s" % named_list(then["paths"]) if then["paths"] else "")
            else:
                what = "the task moved on (its head was step %s at the preview, it is %s now)" % (
                    then["head"], identity["head"])
        else:
            then = before[1]
            changed = sorted(p for p in set(then) | set(states) if then.get(p) != states.get(p))
            what = "changed since the preview: %s" % named_list([repr(p) for p in changed])
        return Conflict("plan_id %s... is not the plan of this restore now: %s. Nothing was "
                        "written; preview again (apply: false) and apply with the plan_id it "
                        "returns" % (plan_id[:12], what))

    @staticmethod
    def _diff(base, plan, current, target):
        """The diff entries of a plan: from each file in the workspace now to
        the target's stored content, each read once."""
        payloads, guard = base.store.payloads, base.guard
        changes = [(rel, change) for key, change in (("to_delete", "delete"),
                                                     ("to_write", "write"),
                                                     ("to_replace", "replace"))
                   for rel in plan[key]]

        def here(rel):
            full = os.path.join(base.root, *rel.split("/"))
            return lambda: read_for_diff(full, within=guard, missing="gone from the workspace")

        def stored(rel):
            return lambda: read_for_diff(payloads.path(target[rel].sha))

        return [change_entry(rel, change, current.get(rel), target.get(rel), here(rel),
                             stored(rel)) for rel, change in sorted(changes)]

    @staticmethod
    def _voided(source, index, head):
        """The steps a restore to step index leaves describing nothing on
        disk, newest first: head and the steps it was saved on (head_before),
        back to index. Steps an earlier restore already undid are not on
        that line; a step recorded without head_before was saved on the one
        before it."""
        voided, number = [], head
        while number > index:
            try:
                step = source.records.read_step(number)
            except (StoreCorrupt, NotFound) as exc:
                voided.append({"index": number, "title": "", "conclusion": "",
                               "damaged": str(exc)})
                number -= 1
                continue
            voided.append({"index": number, "title": step["title"],
                           "conclusion": clipped(step.get("conclusion") or "",
                                                 VOIDED_TEXT_LIMIT)})
            before = step.get("head_before")
            number = before if isinstance(before, int) and 0 <= before < number else number - 1
        return voided

    def _secure_undo(self, ws, snap, plan, target, unseen, scope):
        """The snapshot and plan once the content to delete or overwrite is
        surely stored (Recorder.secure_undo), planned again (a new plan
        object) if it moved."""
        created = snap.created
        try:
            snap, changed = self.recorder.secure_undo(ws, snap,
                                                      plan["to_delete"] + plan["to_replace"])
        except BaseException:
            ws.store.payloads.discard(created)  # nothing records them yet
            raise
        if changed:
            plan = plan_restore(target, snap.entries, ws.store.payloads.has,
                                skipped=snap.skipped, unseen=unseen,
                                policy=self._seen_policy(ws, snap), within=scope,
                                **self._ignore_tests(snap, target, ws.store.payloads))
        return snap, plan

    def _receipt(self, ws, target, done, recovered):
        """{verified, mismatched} of an applied restore: every file it wrote
        read back (content hash and mode against the target), every file it
        deleted looked for. A mismatch is kept in the task's receipt file,
        which tc_resume reports until the next save."""
        written = done["to_write"] + done["to_replace"]
        reasons = in_parallel(lambda rel: written_as(ws, rel, target[rel]), written)
        reasons += [deleted_as(ws, rel) for rel in done["to_delete"]]
        mismatched = sorted(({"path": rel, "reason": reason} for rel, reason in zip(
            written + done["to_delete"], reasons) if reason), key=operator.itemgetter("path"))
        if mismatched:
            try:
                write_record(ws.records.receipt_path, {
                    "format": 1, "recovered": recovered, "count": len(mismatched),
                    "mismatched": mismatched[:RECEIPT_KEPT], "created": now_iso()})
            except OSError as exc:
                self.log("the read-back of restore %s found %d file(s) not as written, and "
                         "that could not be kept for tc_resume: %s"
                         % (recovered, len(mismatched), describe_os_error(exc)))
        return {"verified": len(reasons) - len(mismatched), "mismatched": mismatched}

    def _apply_restore(self, ws, state, target, target_no, snap, plan, head_after, *, same,
                       scope, agent=None):
        journal = Journal(ws.store, "restore", ws.root)
        journal.data["task_id"] = ws.task_id  # whose index a rollback settles
        current = snap.entries
        try:
            for rel in plan["to_delete"]:
                journal.add_entry(rel, (current[rel].sha, current[rel].mode))
            for rel in plan["to_replace"]:
                journal.add_entry(rel, (current[rel].sha, current[rel].mode), target[rel].sha)
            for rel in plan["to_write"]:
                journal.add_entry(rel, None, target[rel].sha)
            journal.data["created_dirs"] = missing_dirs(ws.root,
                                                        plan["to_write"] + plan["to_replace"])
            journal.add_store_new(ws.records.manifests.path(state["last_manifest"] + 1))
            journal.add_store_new(ws.records.drift_path(state["last_drift"] + 1))
            journal.backup_store_file(ws.records.state_path)
            journal.backup_store_file(ws.records.index_path)
            journal.backup_store_file(ws.records.index_log_path)
        except BaseException:
            # Before the journal begins, the undo content is nobody's; after,
            # only the journal's rollback may remove it (it may still need it).
            ws.store.payloads.discard(snap.created)
            raise
        journal.begin(payloads_new=snap.created, discard=snap.created)
        try:
            stats, left = self._apply_plan(ws, journal, target, plan, snap.rows)
            done = plan_without(plan, left)
            rows = self._rows_after_restore(snap, target, done, stats)
            # The recovered record lists what undoing the restore brings back.
            later = []  # its manifest and record, made durable with the state's bytes
            drift = self.recorder.record_drift(
                ws, state, current, None, kind="recovered", head_before=state["head"],
                lists=(done["to_delete"], done["to_replace"], done["to_write"]),
                later=later, unseen=snap.unseen, agent=agent,
                paths=scope.paths if scope else None)
            state["head"] = head_after
            if head_after:
                state["head_manifest"] = ws.records.read_step(head_after)["manifest"]
            entries_after = {rel: row.entry() for rel, row in rows.items()}
            # A manifest of another task is no manifest of this one.
            state["index_manifest"] = target_no if same and entries_after == target else 0
            ws.records.write_state_with(
                state, lambda staged: ws.store.payloads.flush_with(later + staged))
            self.recorder.keep_index(ws, index_after_writes(
                ws, rows, set(done["to_write"]) | set(done["to_replace"]), snap.stamp_ns,
                set(done["to_replace"])))
        except BaseException as exc:
            undo_failed_operation(self.log, journal, "restore", exc)
        journal.finish()
        return drift["id"], journal.left_paths()

    def _apply_plan(self, ws, journal, target, plan, rows):
        """Delete and write what the plan says; rows: the index rows of the
        snapshot it was made from. A file that no longer matches its row (or
        appeared where the snapshot saw none) was written by something else
        since, and is left as it is: nothing of it is lost, and the next scan
        reads it. Returns ({rel: stat} of the files written, [the paths left])."""
        payloads = ws.store.payloads
        emptied = set()
        for rel in plan["to_delete"]:
            full = safe_workspace_path(ws.root, rel)
            journal.touch(rel)
            try:
                remove_within(full, ws.guard, expect=seen_as(rows[rel]))
            except ChangedMeanwhile:
                journal.leave(rel)
                continue
            except BaseException:
                journal.failed_on(rel, full)
                raise
            journal.done(rel, None)
            emptied.add(os.path.dirname(full))
        for folder in sorted(emptied, key=lambda f: -f.count(os.sep)):  # deepest first
            prune_empty_dirs(ws.root, folder, ws.guard)
        made, checked = set(), set()
        writes = []
        left = set(journal.left)
        for rel in plan["to_write"] + plan["to_replace"]:
            if left and in_the_way(rel, left):
                journal.leave(rel, IN_THE_WAY_TEXT)
                continue
            full = safe_workspace_path(ws.root, rel, checked)
            try:
                ensure_dir(os.path.dirname(full), made, ws.guard)
            except (FileExistsError, NotADirectoryError):  # a file made meanwhile stands there
                journal.leave(rel, IN_THE_WAY_TEXT)
                continue
            writes.append((rel, full))
        guard = ws.guard
        stats = in_parallel(lambda item: self._restore_file(
            payloads, journal, target, guard, *item, seen_as(rows.get(item[0]))), writes)
        written = {rel: st for (rel, _full), st in zip(writes, stats) if st is not None}
        return written, journal.left

    @staticmethod
    def _restore_file(payloads, journal, target, guard, rel, full, expect):
        """Write one file of a restore (its directory exists); its stat after,
        or None when it was left as it is: it no longer is what the plan saw,
        expect (see check_expected). guard: the workspace's kernel_path."""
        _kind, sha, _size, mode, _mtime = target[rel]
        journal.touch(rel)
        st = lstat_or_none(full)
        if st is not None and stat_mod.S_ISDIR(st.st_mode) and expect is None:
            try:
                rmdir_within(full, guard)  # only an empty directory may give way to a file
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                journal.leave(rel, FOLDER_IN_THE_WAY_TEXT)
                return None
            st = None
        try:
            check_expected(st, expect, full)
            if st is not None and st.st_nlink > 1:
                raise PermissionError("hard-linked")  # writing through would change the other names
            after = payloads.write_over(sha, full, mode, within=guard, exists=st is not None,
                                        expect=expect)
        except ChangedMeanwhile:
            journal.leave(rel)
            return None
        except PermissionError:  # read-only or hard-linked: replace the name instead
            try:
                after = replace_through(journal.temp_name(full), full, rel, guard,
                                        lambda tmp: payloads.copy_out(sha, tmp, mode,
                                                                      within=guard))
            except BaseException:
                journal.failed_on(rel, full)
                raise
        except BaseException:
            journal.failed_on(rel, full)
            raise
        journal.done(rel, after)
        return after

    @staticmethod
    def _rows_after_restore(snap, target, plan, stats):
        """Index rows after a restore: the written files' stat as they were
        closed (no second stat of each)."""
        rows = dict(snap.rows)
        for rel in plan["to_delete"]:
            rows.pop(rel, None)
        for rel in plan["to_write"] + plan["to_replace"]:
            st = stats[rel]
            info = StatInfo(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                            stat_mod.S_IMODE(st.st_mode), False)
            rows[rel] = index_row(info, KIND_FILE, target[rel].sha)
        return rows


# - - - 15.5 Compaction: tc_compress ------------------------------------------

def tree_bytes(directory):
    """The bytes of every file under directory (their sizes, not the blocks
    they take); what cannot be read counts as nothing."""
    total = 0
    stack = [directory]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        else:
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


class CompressPlan(collections.namedtuple(
        "CompressPlan", "drifts chosen needed unreclaimed eligible already_gone")):
    """What a compress converts: chosen maps a drift record's key to the
    content it gives up; needed is the content the records that stay (and
    the steps, recovered records and indexes) still need; unreclaimed, what
    records compressed earlier gave up and may still be stored."""

    __slots__ = ()

    def freed(self):
        """The content the plan deletes."""
        out = set(self.unreclaimed)
        for shas in self.chosen.values():
            out.update(shas)
        return out - self.needed

class Compaction:
    """tc_compress: which drift content may go, marking its records
    first, then deleting it; and the budget pass (keep_to_budget), which
    does the same for the oldest drift records when the store is over
    TC_STORE_BUDGET."""

    def __init__(self, budget=None, log=None):
        self.budget = budget
        self.log = log or (lambda message: None)

    def keep_to_budget(self, ws):
        """After a record was written (under the lock): when the store is
        over its budget, reclaim the content only drift records hold, the
        oldest records first, until it fits. Never a step's content, a
        recovered record's, or the newest BUDGET_KEEPS_NEWEST drift records
        of a task; nothing at all when the steps (with recovered records
        and indexes) are over the budget by themselves. When what may not
        go keeps the store over, as much as may go goes, and tc_resume's
        health says the store is over. The outcome goes to the store's
        budget note and the log."""
        store = ws.store
        total = tree_bytes(store.directory)
        note = store.budget_note()
        if total <= self.budget:
            if note.get("over"):
                self._write_note(store, note, total=total, kept=None)
            return None
        protected = self._protected_content(store)
        drifts, holders = self._budget_candidates(store)
        sizes = dict(store.payloads.stored_before(1 << 62))
        held = collections.Counter(sha for key in drifts for sha in drifts[key][3])
        only_theirs = {sha for sha, count in held.items()
                       if count == holders[sha] and sha not in protected}
        kept = total - sum(sizes.get(sha, 0) for sha in only_theirs)
        steps_need = total - sum(sizes.get(sha, 0) for sha in holders if sha not in protected)
        if steps_need > self.budget or not only_theirs:
            if not note.get("over") or note.get("budget") != self.budget:
                self.log("TC_STORE_BUDGET (%d bytes): the store holds %d bytes, and its steps, "
                         "recovered records and newest drift records alone need %d; nothing "
                         "was reclaimed" % (self.budget, total, kept))
            self._write_note(store, note, total=total, kept=kept)
            return None
        chosen, freed_bytes = {}, 0
        for key in sorted(drifts, key=lambda k: drifts[k][1].get("created_ns", 0)):
            if total - freed_bytes + BUDGET_MARGIN <= self.budget:
                break
            shas = drifts[key][3]
            if shas <= protected:
                continue  # holds nothing a budget may take: it stays restorable
            chosen[key] = shas - protected
            for sha in shas:
                holders[sha] -= 1
                if not holders[sha] and sha not in protected:
                    freed_bytes += sizes.get(sha, 0)
        needed = protected | {sha for sha, count in holders.items() if count}
        items = {key: drifts[key][:3] for key in chosen}
        freed, done_bytes = self._mark_compressed_all(store.payloads, items, chosen, needed,
                                                      set())
        done_bytes += sum(store.payloads.delete(sha) for sha in sorted(freed))
        total = tree_bytes(store.directory)
        over = total > self.budget
        self.log("TC_STORE_BUDGET (%d bytes): reclaimed the content of %d drift record(s) "
                 "(%s), %d bytes; the store now holds %d bytes%s"
                 % (self.budget, len(chosen), ", ".join(
                     "%s %s" % (task_id, "d%04d" % number) for task_id, number in
                     sorted(chosen)[:10]) + (" ..." if len(chosen) > 10 else ""),
                    done_bytes, total, ", still over: its steps, recovered records and newest "
                    "drift records need more" if over else ""))
        self._write_note(store, note, total=total, kept=total if over else None,
                         reclaimed=(len(chosen), done_bytes))
        return {"records": len(chosen), "bytes": done_bytes}

    @staticmethod
    def _budget_candidates(store):
        """({key: (records, drift, entries, file shas)} of the drift records a
        budget may reclaim, in every task of the store; {sha: how many
        restorable drift records hold it})."""
        out, holders = {}, collections.Counter()
        for task_id in store.task_ids():
            records = store.task(task_id)
            if not records.exists():
                continue
            numbers = records.drift_numbers()
            newest = set(numbers[-BUDGET_KEEPS_NEWEST:])
            for number in numbers:
                drift = records.read_drift("d%04d" % number)
                if drift.get("compressed"):
                    continue
                entries = records.manifests.load(drift["manifest"])
                shas = {e.sha for e in entries.values() if e.kind == KIND_FILE}
                holders.update(shas)
                if drift.get("kind") != "recovered" and number not in newest:
                    out[(task_id, number)] = (records, drift, entries, shas)
        return out, holders

    def _write_note(self, store, note, *, total, kept, reclaimed=None):
        """Record a budget pass's outcome in the store's budget note: the
        budget, the store's size, whether it is over for good (kept: the
        bytes that may not be reclaimed, or None when it fits), and the
        records and bytes reclaimed so far."""
        note = dict(note, format=1, budget=self.budget, checked=now_iso(), total_bytes=total,
                    over=kept is not None, kept_bytes=kept)
        if reclaimed:
            note["reclaimed_records"] = note.get("reclaimed_records", 0) + reclaimed[0]
            note["reclaimed_bytes"] = note.get("reclaimed_bytes", 0) + reclaimed[1]
            note["passes"] = note.get("passes", 0) + 1
            note["last_reclaimed"] = now_iso()
        write_json(store.budget_path, note)

    @staticmethod
    def check_limits(keep_seconds, minimum, maximum):
        """Refuse limits that are not whole numbers >= 0; the minimum that
        applies. At most maximum copies are kept whatever minimum says (a
        call that passes only a small maximum meets the default minimum):
        the result gives the minimum that applied."""
        for name, value in (("keep_seconds", keep_seconds), ("minimum", minimum),
                            ("maximum", maximum)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument("%s must be a whole number >= 0, got %r" % (name, value))
        return min(minimum, maximum)

    def compress(self, ws, *, keep_seconds, minimum, maximum, dry_run=False):
        """Reclaim drift content of ws's workspace (under the lock); with
        dry_run, only say what would go. Either way the result's usage says
        where the store's space goes (after the compress)."""
        if not dry_run:
            ws.need_writable()
        protected = self._protected_content(ws.store)
        plan = self._plan(ws, protected, keep_seconds, minimum, maximum)
        result = {"converted": len(plan.chosen), "eligible": plan.eligible,
                  "already_gone": plan.already_gone, "bytes_freed": 0,
                  "keep_seconds": keep_seconds, "minimum": minimum, "maximum": maximum,
                  "dry_run": bool(dry_run)}
        payloads = ws.store.payloads
        if dry_run:
            freed = plan.freed()
            orphans = self._unreferenced_content(ws.store, keep_seconds, plan.needed | freed)
            result["bytes_freed"] = sum(payloads.size(sha) or 0 for sha in freed | set(orphans))
        else:
            # Content an earlier compress marked but did not get to delete
            # (it was stopped between the two) is reclaimed now.
            freed, result["bytes_freed"] = self._mark_compressed_all(
                payloads, plan.drifts, plan.chosen, plan.needed, plan.unreclaimed - plan.needed)
            result["bytes_freed"] += sum(payloads.delete(sha) for sha in sorted(freed))
            orphans = self._unreferenced_content(ws.store, keep_seconds, plan.needed | freed)
            result["bytes_freed"] += sum(payloads.delete(sha) for sha in orphans)
        result["unreferenced"] = len(orphans)
        result["usage"] = self.usage(ws, protected, minimum, maximum)
        return result

    def _plan(self, ws, protected, keep_seconds, minimum, maximum):
        """What a compress with these limits converts, and the content the
        records that stay still need."""
        drifts, unreclaimed = self._compressible_drifts(ws)
        eligible = self._eligible_copies(drifts, keep_seconds, minimum, maximum)
        chosen, gone = {}, 0
        for drift_key, sha in eligible:
            if sha in protected:
                continue
            if not ws.store.payloads.has(sha):
                gone += 1
            chosen.setdefault(drift_key, set()).add(sha)
        needed = set(protected) | self._content_of_other_drifts(ws.store, drifts, chosen)
        return CompressPlan(drifts, chosen, needed, unreclaimed, len(eligible), gone)

    def usage(self, ws, protected, minimum, maximum):
        """Where the store's bytes go: the whole store, its content, each
        task (its records, and the content they name: shared content counts
        for each task naming it), the content only drift records hold, and
        what a compress with keep_seconds 0 (and these limits) would free."""
        store = ws.store
        sizes = dict(store.payloads.stored_before(1 << 62))
        tasks, drift_held = [], set()
        for task_id in store.task_ids():
            records = store.task(task_id)
            if not records.exists():
                continue
            named, steps, drifts = self._task_content(records, drift_held)
            state = records.read_state()
            tasks.append({"task_id": task_id, "root": state.get("root"),
                          "status": state.get("status"), "steps": steps, "drifts": drifts,
                          "record_bytes": tree_bytes(records.directory),
                          "content_bytes": sum(sizes.get(sha, 0) for sha in named)})
        plan = self._plan(ws, protected, 0, minimum, maximum)
        at_zero = plan.freed()
        at_zero.update(self._unreferenced_content(store, 0, plan.needed | at_zero))
        return {"total_bytes": tree_bytes(store.directory),
                "content_bytes": sum(sizes.values()), "content_files": len(sizes),
                "tasks": tasks,
                "drift_only_bytes": sum(sizes.get(sha, 0) for sha in drift_held - protected),
                "freed_at_keep_seconds_0": sum(sizes.get(sha, 0) for sha in at_zero),
                "budget": self.budget_view(store)}

    def budget_view(self, store):
        """The budget and what its passes did, as usage shows it."""
        note = store.budget_note()
        return {"bytes": self.budget, "over": bool(self.budget and note.get("over")
                                                   and note.get("budget") == self.budget),
                "reclaimed_records": note.get("reclaimed_records", 0),
                "reclaimed_bytes": note.get("reclaimed_bytes", 0),
                "last_reclaimed": note.get("last_reclaimed")}

    @staticmethod
    def _task_content(records, drift_held):
        """(the shas a task's records name, its step count, its drift record
        count); drift_held receives the shas of its restorable drift records."""
        named = set()
        steps, drifts = records.step_numbers(), records.drift_numbers()
        for number in steps:
            named.update(e.sha for e in records.manifests.load(
                records.read_step(number)["manifest"]).values())
        for number in drifts:
            drift = records.read_drift("d%04d" % number)
            if drift.get("compressed"):
                continue
            shas = {e.sha for e in records.manifests.load(drift["manifest"]).values()}
            named.update(shas)
            if drift.get("kind") != "recovered":
                drift_held.update(shas)
        named.update(row.sha for row in records.read_index()["files"].values())
        named.discard(None)
        drift_held.discard(None)
        return named, len(steps), len(drifts)

    def _mark_compressed_all(self, payloads, drifts, chosen, needed, freed):
        """Mark every chosen drift record compressed (chosen: record key ->
        the content it gives up), then say what may go: (the content to
        delete, bytes already freed). The records are marked before their
        content is deleted; on a full disk, the content of the records still
        to mark is deleted first to make room, when that makes enough."""
        order = sorted(chosen)
        marked = 0
        try:
            for key in order:
                self._mark_compressed(drifts[key], chosen[key])
                marked += 1
                freed.update(chosen[key] - needed)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # Until they are marked the records still list as restorable,
            # and a restore of one names that content as missing.
            for key in order[marked:]:
                freed.update(chosen[key] - needed)
            if self._bytes_of(payloads, freed) < ROOM_MARGIN + sum(
                    self._bytes_of_record(drifts[key]) for key in order[marked:]):
                raise  # too little to make room: nothing is deleted unmarked
            freed_bytes = sum(payloads.delete(sha) for sha in sorted(freed))
            try:
                for key in order[marked:]:
                    self._mark_compressed(drifts[key], chosen[key])
                    marked += 1
            except OSError as again:
                if again.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise StoreUnwritable(
                    "tc_compress freed %d bytes, but the disk is still full: %d drift "
                    "record(s) whose content it removed are not marked yet (free more "
                    "space and run tc_compress again to finish)"
                    % (freed_bytes, len(order) - marked)) from None
            return set(), freed_bytes
        return freed, 0

    @staticmethod
    def _bytes_of(payloads, shas):
        """The disk space the content shas takes (whole blocks where known)."""
        return sum(disk_bytes(payloads.path(sha)) for sha in shas)

    @staticmethod
    def _bytes_of_record(drift_item):
        records, drift, _entries = drift_item
        return disk_bytes(records.drift_path(int(drift["id"][1:])))

    @staticmethod
    def _mark_compressed(drift_item, shas):
        """Rewrite a drift record as reclaimed: shas are no longer restorable."""
        records, drift, _entries = drift_item
        drift["compressed"] = True
        drift["unrestorable"] = sorted(shas)
        write_record(records.drift_path(int(drift["id"][1:])), drift)

    @staticmethod
    def _unreferenced_content(store, keep_seconds, needed):
        """Stored content older than keep_seconds that no record of the store
        names: what a save or capture stopped between writing its content and
        its records (killed, a disk full just then) left behind. Any store
        record naming a sha keeps it, whatever field names it; a record that
        cannot be read keeps everything. Called under the store lock, where
        no other writer is between those two points."""
        cutoff_ns = time.time_ns() - keep_seconds * 1_000_000_000
        candidates = [sha for sha, _size in store.payloads.stored_before(cutoff_ns)
                      if sha not in needed]
        if not candidates:
            return []
        named = store.named_content()
        if named is None:
            return []
        return sorted(sha for sha in candidates if sha not in named)

    def _protected_content(self, store):
        """Content no compress may touch: steps, recovered records, every index."""
        protected = set()
        for task_id in store.task_ids():
            records = store.task(task_id)
            if not records.exists():
                continue
            try:
                for number in records.step_numbers():
                    step = records.read_step(number)
                    protected.update(e.sha for e in records.manifests.load(step["manifest"]).values())
                for number in records.drift_numbers():
                    drift = records.read_drift("d%04d" % number)
                    if drift.get("kind") == "recovered":
                        protected.update(e.sha for e in records.manifests.load(drift["manifest"]).values())
                protected.update(row.sha for row in records.read_index()["files"].values())
            except (StoreCorrupt, NotFound, KeyError) as exc:
                raise StoreCorrupt("cannot tell which content task %r still needs (%s); "
                                   "nothing was reclaimed" % (task_id, exc)) from None
        protected.update(self._kept_content(store))
        protected.discard(None)
        return protected

    @staticmethod
    def _kept_content(store):
        """The content rollbacks kept (kept/<op>.json): what files held that
        could not be put back."""
        directory = os.path.join(store.directory, KEPT_DIRNAME)
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
        except FileNotFoundError:
            return set()
        except OSError as exc:
            raise StoreCorrupt("cannot read %r (%s); nothing was reclaimed"
                               % (directory, describe_os_error(exc))) from None
        kept = set()
        for name in names:
            path = os.path.join(directory, name)
            try:
                doc = read_json(path)
                shas = [before[0] for part in ("files", "edited")
                        for before in (doc.get(part) or {}).values()]
            except FileNotFoundError:
                continue
            except (OSError, StoreCorrupt, AttributeError, TypeError, IndexError, KeyError):
                shas = None
            if shas is None or not all(isinstance(sha, str) and _SHA256.match(sha)
                                       for sha in shas):
                raise StoreCorrupt("%r cannot be read as a list of kept content, so nothing "
                                   "was reclaimed; copy out what it names, or move it out of "
                                   "the store if it is not needed, and retry" % path)
            kept.update(shas)
        return kept

    def _content_of_other_drifts(self, store, drifts, chosen):
        """Content every drift that stays restorable still needs, in any task
        of the store (several workspaces may share it)."""
        needed = set()
        for task_id in store.task_ids():
            records = store.task(task_id)
            if not records.exists():
                continue
            for number in records.drift_numbers():
                key = (task_id, number)
                if key in chosen:
                    continue
                if key in drifts:
                    entries = drifts[key][2]
                else:
                    drift = records.read_drift("d%04d" % number)
                    if drift.get("compressed"):
                        continue
                    entries = records.manifests.load(drift["manifest"])
                needed.update(e.sha for e in entries.values() if e.kind == KIND_FILE)
        return needed

    def _compressible_drifts(self, ws):
        """The drift records of this workspace's tasks a compress may convert,
        and the content already compressed records gave up."""
        out, unreclaimed = {}, set()
        for task_id in ws.store.task_ids():
            records = ws.store.task(task_id)
            if not records.exists() or records.read_state().get("root") != ws.root:
                continue
            for number in records.drift_numbers():
                drift = records.read_drift("d%04d" % number)
                if drift.get("compressed"):
                    unreclaimed.update(sha for sha in drift.get("unrestorable") or ()
                                       if isinstance(sha, str))
                    continue
                if drift.get("kind") == "recovered":
                    continue
                entries = records.manifests.load(drift["manifest"])
                out[(task_id, number)] = (records, drift, entries)
        return out, unreclaimed

    @staticmethod
    def _eligible_copies(drifts, keep_seconds, minimum, maximum):
        """(drift key, sha) of every copy the retention rules let go."""
        copies = {}
        for key, (_records, drift, entries) in drifts.items():
            for path in drift.get("added", []) + drift.get("modified", []):
                entry = entries.get(path)
                if entry and entry.kind == KIND_FILE:
                    copies.setdefault(path, []).append((drift["created_ns"], key, entry.sha))
        now_ns = time.time_ns()
        eligible = []
        for path, items in copies.items():
            items.sort(reverse=True)
            for position, (created_ns, key, sha) in enumerate(items):
                if position == 0:
                    continue  # the newest copy of a path is always kept
                old = (now_ns - created_ns) >= keep_seconds * 1_000_000_000
                if (position >= minimum and old) or position >= maximum:
                    eligible.append((key, sha))
        return eligible


# - - - 15.6 Export: tc_export ------------------------------------------------

class Exporting:
    """tc_export: a handoff package built under a temporary name and
    renamed into place."""

    def __init__(self, reporting):
        self.reporting = reporting
        self.policies = reporting.policies

    @staticmethod
    def check_destination(to):
        """The real path of to, an existing directory; refused otherwise."""
        to = validate_abs_dir(to, "to")
        if not os.path.isdir(to):
            raise InvalidArgument("to %r must be an existing directory" % to)
        return to

    def export(self, ws, to, *, history):
        """Write ws's package into the folder to; takes the store lock."""
        store = enclosing_store(to)
        if store is None and _at_or_inside(to, os.path.realpath(ws.store.directory)):
            store = ws.store.directory
        if store is not None:
            raise InvalidArgument("to %r is inside the checkpoint store %r; export to a folder "
                                  "outside it" % (to, store))
        if _at_or_inside(to, ws.root):
            raise InvalidArgument("to %r is inside the workspace %r: the next save would record "
                                  "the package and a restore would delete it; export to a "
                                  "folder outside the workspace" % (to, ws.root))
        try:
            with ws.store.lock:
                final, desc, left_out = self._export_locked(ws, to, history)
        except OSError as exc:
            advice = OS_ERROR_ADVICE.get(exc.errno)
            raise CheckpointError("export to %r failed, and its unfinished package was "
                                  "removed: %s%s" % (to, describe_os_error(exc),
                                                     ". " + advice if advice else "")) from None
        return {"path": final, "filtered": desc["filtered"],
                "files": [f["path"] for f in desc["files"]], "changed_since_step": left_out}

    def _export_locked(self, ws, to, history):
        """Build the package under a temporary name in to, then rename it
        into place; (its path, its description, the paths it lacks). While
        it is built, this process holds a lock on its folder and the store
        notes where it is (begin_export): a later lock holder removes it only
        once no process holds that lock, so neither a copy of the store nor
        another server can take a live export's package for a dead one's."""
        ws.follow_active()  # (another server may have switched tasks meanwhile)
        final, prefix, tmp = self._package_names(ws, to)
        for name in os.listdir(to):
            if name.startswith(prefix) and folder_abandoned(os.path.join(to, name)):
                remove_tree(os.path.join(to, name))  # a dead export's
        state = ws.records.read_state()
        left_out = self.reporting.changed_since_step(ws, state)
        note = ws.store.begin_export(tmp)  # first: a kill from here on leaves it noted
        held = None
        try:
            try:
                os.makedirs(tmp)
                held = hold_folder_lock(tmp)
                desc = self._write_package(ws, state, tmp, history, left_out)
                if os.path.lexists(final):
                    raise AlreadyExists("a package %r already exists; move it away or "
                                        "export elsewhere" % final)
                os.rename(tmp, final)
            except BaseException:
                remove_tree(tmp)
                raise
        finally:
            ws.store.end_export(note)
            if held is not None:
                os.close(held)  # (releases the lock)
        return final, desc, left_out

    @staticmethod
    def _package_names(ws, to):
        """(final, temporary-name prefix, temporary path) of ws's package in to;
        a package already there is refused."""
        final = os.path.join(to, "%s-handoff" % ws.task_id)
        if os.path.lexists(final):
            raise AlreadyExists("a package %r already exists; move it away or export "
                                "elsewhere" % final)
        prefix = ".%s-handoff.tmp-" % ws.task_id
        return final, prefix, os.path.join(to, prefix + random_hex(4))

    def _write_package(self, ws, state, tmp, history, left_out):
        step = ws.records.read_step(state["head"]) if state["head"] else None
        manifest_no = step["manifest"] if step else state.get("index_manifest", 0)
        if manifest_no:
            entries = ws.records.manifests.load(manifest_no)
        else:  # no step, and the latest record is known to the index alone (a
            # restore or an import that left some paths as they were)
            entries = ws.records.index_entries(ws.records.read_index())
        files, filtered = self._export_files(ws, entries, os.path.join(tmp, "files"))
        desc = {"format": PACKAGE_FORMAT, "tool": "task-checkpoint-mcp", "version": __version__,
                "task": {k: state.get(k) for k in ("task_id", "name", "goal", "constraints",
                                                   "exclude", "head", "last_step")},
                "step": step, "files": files, "filtered": filtered, "history": [],
                "exported": now_iso()}
        if history:
            desc["history"] = self._export_history(ws, os.path.join(tmp, "history"))
        write_json(os.path.join(tmp, PACKAGE_DESCRIPTION), desc)
        text = handoff_markdown(desc, left_out)
        atomic_write(os.path.join(tmp, "HANDOFF.md"), text.encode("utf-8"))
        return desc

    def _export_files(self, ws, entries, directory):
        """Copy the stored files of entries into directory; (their package
        entries, what was left out and why). A file git now ignores (a step
        recorded before that) is left out too: what git keeps out of a push
        stays out of a package. So is a file whose path inside the package
        would pass the system's path limit there."""
        files, filtered = [], []
        payloads = ws.store.payloads
        entries = sensitive_now(entries, self.policies.of(ws))
        git = self.reporting.recorder.git_view(ws)
        longest = path_length_limit(os.path.dirname(directory))
        for rel, (kind, sha, size, mode, _m) in sorted(entries.items()):
            if kind == KIND_SENSITIVE:
                filtered.append({"path": rel, "reason": "sensitive"})
            elif git is not None and git.ignored(rel):
                filtered.append({"path": rel, "reason": "ignored by git"})
            elif kind == KIND_BIG:
                filtered.append({"path": rel, "reason": "over 100 MB, content not stored"})
            elif not payloads.has(sha):
                filtered.append({"path": rel, "reason": "stored content missing"})
            elif longest and len(os.fsencode(os.path.join(directory, rel))) >= longest:
                filtered.append({"path": rel, "reason": "its path is too long to be written "
                                 "inside the package there; export to a shorter folder"})
            else:
                files.append({"path": rel, "sha256": sha, "size": size, "mode": mode})
        made = set()
        in_parallel(lambda f: copy_tree_file(payloads, f["sha256"], os.path.join(
            directory, *f["path"].split("/")), f["mode"], made), files)
        return files, filtered

    def _export_history(self, ws, directory):
        """Every step's record and full manifest, and each needed content once."""
        policy = self.policies.of(ws)
        steps = []
        payloads = ws.store.payloads
        written, made = set(), set()
        for number in ws.records.step_numbers():
            check_cancelled()
            step = ws.records.read_step(number)
            entries = sensitive_now(ws.records.manifests.load(step["manifest"]), policy)
            for kind, sha, _size, mode, _m in entries.values():
                if kind == KIND_FILE and sha not in written and payloads.has(sha):
                    copy_tree_file(payloads, sha, os.path.join(directory, "payload", sha), 0o644,
                                   made)
                    written.add(sha)
            steps.append({"step": step,
                          "files": {p: list(e) for p, e in sorted(entries.items())}})
        return steps


# - - - 15.7 Import: tc_import ------------------------------------------------

class Importing:
    """tc_import: a package checked whole, journaled, written, and made
    the workspace's active task."""

    def __init__(self, workspaces, recorder, log):
        self.workspaces = workspaces
        self.recorder = recorder
        self.policies = recorder.policies
        self.log = log

    def import_package(self, root, package):
        """Check the package whole, choose the workspace's store and import
        into it; (the result, the Workspace)."""
        root = validate_root(root)
        refuse_pseudo_file_system(root)
        package = validate_abs_dir(package, "package")
        desc = load_package(package)
        task_id = desc["task"]["task_id"]
        with workspace_lock(root):  # no tc_init moves the workspace to another store meanwhile
            self.workspaces.refuse_inside_another(root)
            store = self.workspaces.store(self.workspaces.store_dir_for(root))
            ws = Workspace(root, store, task_id, {"exclude": desc["task"].get("exclude") or []})
            refuse_foreign_paths(desc, self.policies.of(ws))
            new_store = not os.path.lexists(store.directory)
            with store.lock:
                try:
                    ws.need_writable()
                    if ws.records.exists() or os.path.lexists(ws.records.directory):
                        raise AlreadyExists("task %r already exists in the store %r; nothing "
                                            "was imported" % (task_id, store.directory))
                    self.workspaces.release_caches(keep=store)
                    self.policies.clear()
                    recovered, left = self._import_locked(ws, package, desc)
                except BaseException:
                    if new_store:
                        self._remove_new_store(store)
                    raise
        return {"task_id": task_id, "recovered": recovered, "skipped_paths": left}, ws

    @staticmethod
    def _remove_new_store(store):
        """After a refused import into a workspace that had no store: the
        store it made goes again (under the lock), so the workspace is as it
        was; unless a rollback still needs it (a journal left to retry,
        content kept of files not put back) or another call made a task in
        it meanwhile."""
        if (store.journal_dirs() or store.task_ids()
                or os.path.lexists(os.path.join(store.directory, KEPT_DIRNAME))):
            return
        remove_tree(store.directory)
        store.forget_caches()

    def _import_locked(self, ws, package, desc):
        """Journal, write and record an import; returns (the recovered drift
        id when files already in the workspace were overwritten, else None;
        the paths left as they were, changed since the import's snapshot)."""
        payloads = ws.store.payloads
        # The workspace as it is, content stored: the undo point for overwritten files.
        pre = self.recorder.snapshot(ws, store_content=True)
        history = []  # payloads this import stored from the package's history
        try:
            pre, journal, overwritten, fulls, new_payloads = self._import_plan(
                ws, package, desc, pre, history)
        except BaseException:
            # Before the journal begins, what this import stored is nobody's.
            payloads.discard(pre.created + history)
            raise
        journal.begin(payloads_new=new_payloads + pre.created, discard=pre.created + history)
        try:
            recovered = self._import_apply(ws, journal, package, desc, pre, overwritten, fulls)
        except BaseException as exc:
            undo_failed_operation(self.log, journal, "import", exc)
        journal.finish()
        return recovered, journal.left_paths()

    def _import_plan(self, ws, package, desc, pre, history):
        """The import's journal, not yet begun, with what it must know: the
        snapshot with its undo content secured, the files it overwrites,
        their absolute paths, and the payloads it adds (history: those stored
        from the package's history, as they are stored)."""
        payloads = ws.store.payloads
        pre, _ = self.recorder.secure_undo(ws, pre, [f["path"] for f in desc["files"]])
        journal = Journal(ws.store, "import", ws.root)
        overwritten = []
        checked = set()  # folders found not to be links, for every call of this import
        fulls = {}
        for item in desc["files"]:
            rel = item["path"]
            full = fulls[rel] = safe_workspace_path(ws.root, rel, checked)  # refused up front
            have = pre.entries.get(rel)
            if have is None and os.path.lexists(full) and not os.path.isdir(full):
                raise Conflict("%r is in the workspace but could not be read; nothing was "
                               "imported" % rel)
            if have is not None and have.kind != KIND_FILE:
                raise Conflict("%r in the workspace has no stored copy (sensitive or over "
                               "100 MB); move it away, then import" % rel)
            if have is not None and (have.sha, have.mode) != (item["sha256"], item["mode"] & 0o777):
                overwritten.append(rel)
            journal.add_entry(rel, (have.sha, have.mode) if have else None, item["sha256"])
        for sha in carried_history_shas(package, desc):
            check_cancelled()
            written = payloads.put_file(os.path.join(package, "history", "payload", sha))[3]
            if written:
                history.append(written)
        new_payloads = history + payloads.missing([f["sha256"] for f in desc["files"]])
        journal.data["created_dirs"] = missing_dirs(ws.root, [f["path"] for f in desc["files"]])
        journal.data["store_new_dirs"] = [os.path.relpath(ws.records.directory, ws.store.directory)]
        journal.backup_store_file(ws.store.current_path)
        return pre, journal, overwritten, fulls, new_payloads

    def _import_apply(self, ws, journal, package, desc, pre, overwritten, fulls):
        """Write the package's files (paths checked by the caller, fulls: rel ->
        absolute path; the last component is opened without following a link),
        then the task's records."""
        payloads = ws.store.payloads
        rows = dict(pre.rows)
        rows.update(self._import_files(ws, journal, package, desc, pre, fulls))
        left = set(journal.left)
        # The records, any content another thread of this import stored
        # meanwhile and the state's bytes are made durable in one batch.
        later = []
        state = self._import_records(ws, desc, later)
        recovered = None
        overwritten = [rel for rel in overwritten if rel not in left]
        if overwritten:
            new_paths = sorted({f["path"] for f in desc["files"]} - set(pre.entries) - left)
            recovered = self.recorder.record_drift(ws, state, pre.entries, None, kind="recovered",
                                           lists=([], overwritten, new_paths),
                                           reason="workspace before the import",
                                           later=later, unseen=pre.unseen)["id"]
        written = {item["path"] for item in desc["files"]} - left
        self.recorder.keep_index(ws, index_after_writes(
            ws, rows, written, pre.stamp_ns, written.intersection(pre.entries)), whole=True)
        ws.records.write_state_with(state, lambda staged: payloads.flush_with(later + staged))
        ws.store.make_active(ws.root, ws.task_id, ws.store.read_current().get(ws.root))
        return recovered

    def _import_files(self, ws, journal, package, desc, pre, fulls):
        """Store the package's new content, then write its files into the
        workspace; {rel: index row} of each file written. A file something
        else wrote since the snapshot pre is left as it is (Journal.leave)."""
        payloads = ws.store.payloads
        made = set()
        for item in desc["files"]:
            ensure_dir(os.path.dirname(fulls[item["path"]]), made, ws.guard)

        def package_file(item):
            # Checked in load_package; opened without following a link.
            return os.path.join(package, "files", *item["path"].split("/"))

        fresh = self._import_store_content(payloads, desc, package_file)

        def write(item, dest, expect):
            sha, mode = item["sha256"], item["mode"] & 0o777
            if sha in fresh:
                return payloads.place_stored(sha, dest, mode, within=ws.guard, expect=expect)
            return payloads.import_file(package_file(item), dest, sha, mode, within=ws.guard,
                                        expect=expect)

        def place(item):
            rel = item["path"]
            try:
                st = self._import_place(ws, journal, rel, fulls[rel],
                                        seen_as(pre.rows.get(rel)),
                                        lambda dest, expect: write(item, dest, expect))
            except ChangedMeanwhile:  # the next scan reads what is there now
                journal.leave(rel)
                return None
            except BaseException:
                journal.failed_on(rel, fulls[rel])
                raise
            journal.done(rel, st)
            info = StatInfo(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev,
                            stat_mod.S_IMODE(st.st_mode), False)
            return index_row(info, KIND_FILE, item["sha256"])

        return {item["path"]: row for item, row in zip(desc["files"],
                                                      in_parallel(place, desc["files"]))
                if row is not None}

    @staticmethod
    def _import_store_content(payloads, desc, package_file):
        """Store the package's content the store lacks, each checked against
        its hash, and flush it; returns the shas stored. This comes before
        the workspace copies exist: the flush then writes back only the
        store's copies, and the workspace copies are made from them by the
        kernel. A second path with the same new content is written from the
        store's copy too; its own package file is only checked."""
        missing = set(payloads.missing({item["sha256"] for item in desc["files"]}))
        firsts, repeats = {}, []
        for item in desc["files"]:
            if item["sha256"] in missing:
                if item["sha256"] in firsts:
                    repeats.append(item)
                else:
                    firsts[item["sha256"]] = item

        def store_or_check(item):
            if firsts[item["sha256"]] is item:
                return payloads.store_verified(package_file(item), item["sha256"])
            check_package_file(package_file(item), item["sha256"])
            return None

        stored = in_parallel(store_or_check, list(firsts.values()) + repeats)
        payloads.flush()
        return {sha for sha, written in zip(firsts, stored) if written}

    @staticmethod
    def _import_place(ws, journal, rel, full, expect, write):
        """Write one imported file at full (write(dest, expect) writes its
        content and returns the written file's stat) and return that stat.
        A link there is refused, an empty folder gives way, and a file with
        other links or without write permission is replaced through a
        staging name, so no other link sees the new content. expect: what
        the import's snapshot saw there (see check_expected);
        ChangedMeanwhile, with nothing written, when it no longer matches."""
        journal.touch(rel)
        st = lstat_or_none(full)
        if st is not None and stat_mod.S_ISLNK(st.st_mode):
            raise UnsafePath("path %r is a symlink" % rel)
        if st is not None and stat_mod.S_ISDIR(st.st_mode) and expect is None:
            rmdir_within(full, ws.guard)  # only an empty directory may give way
            st = None
        check_expected(st, expect, full)
        if st is not None and (st.st_nlink > 1 or not os.access(full, os.W_OK)):
            return replace_through(journal.temp_name(full), full, rel, ws.guard,
                                   lambda tmp: write(tmp, ANY_STATE))
        return write(full, expect)

    def _import_records(self, ws, desc, later):
        """The imported steps' manifests and records, written for the
        caller to make durable (see write_record); the new task state."""
        task = desc["task"]
        state = make_state(task_id=ws.task_id, name=task["name"], goal=task.get("goal") or "",
                           constraints=task.get("constraints") or "", root=ws.root,
                           exclude=PathPolicy.check_patterns(task.get("exclude") or []))
        # Only content crosses: a sensitive or over-limit file of the sender
        # is no file of this workspace, so its steps here do not list it
        # (as with a package without history), and nothing here reads as
        # changed for lacking it.
        steps = [(h["step"], {p: manifest_entry(e.kind, e.sha, e.size, e.mode & 0o777, e.mtime_ns)
                              for p, e in h["files"].items() if e.kind == KIND_FILE})
                 for h in desc.get("history") or []]
        if not steps and desc.get("step"):
            current = {f["path"]: manifest_entry(KIND_FILE, f["sha256"], f["size"],
                                                 f["mode"] & 0o777)
                       for f in desc["files"]}
            steps = [(desc["step"], current)]
        head = desc["step"]["index"] if desc.get("step") else 0
        for step, entries in steps:
            number = self.recorder.record_manifest(ws, state, entries, later)
            record = dict(step, manifest=number)
            write_record(ws.records.step_path(record["index"]), record, later)
            state["last_step"] = max(state["last_step"], record["index"])
            if record["index"] == head:
                state["head_manifest"] = number
        state["head"] = head
        # Steps the sender numbered after its head (a restore moved the head
        # back) keep their numbers there: the next step here comes after them.
        state["last_step"] = max(state["last_step"], head, task.get("last_step") or 0)
        state["index_manifest"] = 0
        return state


# ---------------------------------------------------------------------------
# 16. Checkpoints: the facade
# ---------------------------------------------------------------------------


def noted(ws, result):
    """result with what this call found done first (a dead writer's restore
    rolled back, Store.take_recovered) and ws.note (a moved workspace, an
    adopted task) ahead of any note of its own."""
    store = getattr(ws, "store", None)
    said = store.take_recovered() if store is not None else []
    if getattr(ws, "note", None):
        said.append(ws.note)
    if said:
        if result.get("note"):
            said.append(result["note"])
        result["note"] = "; ".join(said)
    return result


class Checkpoints:
    """The facade: the ten operations, each a public method returning a
    plain dict. Every one has the same shape: resolve the workspace (root,
    task), take the store lock, run the operation, then note the workspace
    for the watcher. The operations themselves are the classes above."""

    def __init__(self, config=None, *, log=None, lock_timeout=LOCK_TIMEOUT):
        """lock_timeout: how long a call waits for a store another process
        holds (a hook waits little: its client waits for it)."""
        self.config = config or Config.from_env()
        self._log_sink = log
        self._lock = threading.RLock()
        self._watched = {}  # root -> the store directory its task is in
        self.workspaces = Workspaces(self.config, self.log, lock_timeout=lock_timeout)
        self.policies = PolicyCache()
        self.recorder = Recorder(self.config, self.policies, self.log)
        self.git = GitRefWriter(enabled=self.config.git, verify=self.config.git_verify,
                                log=self.log)
        self.setup = TaskSetup(self.workspaces, self.recorder)
        self.saving = Saving(self.recorder, self.git, self.log)
        self.reporting = Reporting(self.recorder)
        self.restoring = Restoring(self.recorder, self.log)
        self.compaction = Compaction(self.config.store_budget, self.log)
        self.exporting = Exporting(self.reporting)
        self.importing = Importing(self.workspaces, self.recorder, self.log)
        self.watcher = None

    def log(self, message, store=None):
        """Pass message to the log sink; store: the store directory it is
        about, for a sink that keeps a log in each store (per_store)."""
        if self._log_sink:
            try:
                if store is not None and getattr(self._log_sink, "per_store", False):
                    self._log_sink(message, store=store)
                else:
                    self._log_sink(message)
            except Exception:
                pass

    # -- the ten tools ------------------------------------------------------

    def init(self, root, name, *, goal="", constraints="", store=None, exclude=None,
             agent=None):
        agent = validate_agent(agent)
        result, ws = self.setup.init(root, name, goal=goal, constraints=constraints,
                                     store=store, exclude=exclude, agent=agent)
        self._watch(ws.root, ws.store)
        return noted(ws, result)

    def switch(self, root, task_id):
        ws = self.workspaces.resolve(root, task_id, adopt=True)
        with ws.store.lock:
            result = self.setup.switch(ws)
        self._watch(ws.root, ws.store)
        return noted(ws, result)

    def save(self, root, title, *, task_id=None, description="", conclusion="", next="",
             verified=(), open_questions=(), close=False, paths=(), expected_head=None,
             agent=None):
        Saving.check_save(title, paths)
        expected_head, agent = validate_expected_head(expected_head), validate_agent(agent)
        ws = self.workspaces.resolve(root, task_id)
        with ws.store.lock:
            result = self.saving.save(ws, title.strip(), description=description or "",
                                      conclusion=conclusion or "", next_step=next or "",
                                      verified=list(verified or ()),
                                      open_questions=list(open_questions or ()),
                                      close=bool(close), expected_head=expected_head,
                                      agent=agent)
            self._keep_to_budget(ws)
        self._recorded(ws)
        return noted(ws, result)

    def capture(self, root, *, source="capture", partial=False, agent=None, label=None):
        """Record the workspace's unrecorded changes now. waiting: the watcher
        was still waiting for them to settle, so the record is partial."""
        agent = validate_agent(agent)
        Saving.check_label(label)
        ws = self.workspaces.resolve(root)
        # A watcher capture comes after its own quiet period (or is partial by
        # its own decision); a tool call captures what the watcher still waits on.
        waiting = bool(source != "watch" and self.watcher and self.watcher.is_waiting(ws.root))
        with ws.store.lock:
            result = self.saving.capture(ws, source=source, partial=partial, waiting=waiting,
                                         agent=agent, label=label)
            if result["captured"]:
                self._keep_to_budget(ws)
        self._watch(ws.root, ws.store)
        if source == "capture":
            self._reset_watcher(ws)
        return noted(ws, result)

    def show(self, root, *, task_id=None, index=None, include_drift=False, limit=50, cursor=0,
             diff=False):
        """Steps and drift records as the store has them: only records are
        read (and, with diff, the stored content compared); the workspace
        is never scanned."""
        Reporting.check_show(index, diff)
        ws = self.workspaces.resolve(root, task_id)
        with ws.store.lock:
            result = self.reporting.show(ws, index=index, include_drift=include_drift,
                                         limit=limit, cursor=cursor, diff=bool(diff))
        self._watch(ws.root, ws.store)
        return noted(ws, result)

    def steps_diff(self, root, first, second, *, task_id=None):
        """What differs from step first to step second (see Reporting.steps_diff)."""
        ws = self.workspaces.resolve(root, task_id)
        with ws.store.lock:
            result = self.reporting.steps_diff(ws, first, second)
        return noted(ws, result)

    def resume(self, root, *, task_id=None):
        """Read-only: where the task stands, and what changed since it was recorded."""
        ws = self.workspaces.resolve(root, task_id, lenient=True)
        result = self.reporting.resume(ws)  # its scan runs outside the lock
        self._watch(ws.root, ws.store)  # a new session starts here: record from now on
        return noted(ws, result)

    def restore(self, root, *, index=None, drift_id=None, apply=False, task_id=None,
                paths=None, diff=False, plan_id=None, expected_head=None, agent=None):
        Restoring.check_target(index, drift_id)
        paths = Restoring.check_options(paths, plan_id)
        expected_head, agent = validate_expected_head(expected_head), validate_agent(agent)
        ws = Restoring.named_task(self.workspaces, root, task_id)
        with ws.store.lock:
            result = self.restoring.restore(ws, index=index, drift_id=drift_id,
                                            apply=bool(apply), named=task_id is not None,
                                            paths=paths, diff=bool(diff), plan_id=plan_id,
                                            expected_head=expected_head, agent=agent)
        if apply:
            self._recorded(ws)
        else:
            self._watch(ws.root, ws.store)
        return noted(ws, result)

    def compress(self, root, *, keep_seconds=604800, minimum=20, maximum=50, dry_run=False):
        minimum = Compaction.check_limits(keep_seconds, minimum, maximum)
        ws = self.workspaces.resolve(root)
        with ws.store.lock:
            result = self.compaction.compress(ws, keep_seconds=keep_seconds, minimum=minimum,
                                              maximum=maximum, dry_run=bool(dry_run))
        return noted(ws, result)

    def export(self, root, to, *, history=False):
        to = Exporting.check_destination(to)
        ws = self.workspaces.resolve(root)
        result = self.exporting.export(ws, to, history=history)  # it holds the lock itself
        self._watch(ws.root, ws.store)
        return noted(ws, result)

    def import_package(self, root, package):
        result, ws = self.importing.import_package(root, package)
        self._watch(ws.root, ws.store)
        return noted(ws, result)

    def store_directory(self, root):
        """Where root's store is (or would be); nothing is read or written
        but the workspace's store pointer."""
        return self.workspaces.store_dir_for(validate_root(root))

    # -- the watcher --------------------------------------------------------

    def unrecorded_signature(self, root, walked=None):
        """What the watcher compares between ticks (see Saving.unrecorded_signature)."""
        with self._lock:
            store_dir = self._watched.get(root)
        ws = self.workspaces.resolve(root)
        return self.saving.unrecorded_signature(ws, store_dir, walked)

    def start_watcher(self):
        """Start the watcher thread (unless TC_WATCH=off).

        With TC_STORE set, the workspaces whose tasks are active in that store
        are watched from the start, so a restarted server keeps recording
        before its first tool call.
        """
        if self.config.watch and self.config.store and os.path.isdir(self.config.store):
            store = self.workspaces.store(self.config.store)
            try:
                roots = store.read_current()
            except (StoreCorrupt, OSError):
                roots = {}
            for root in roots:
                if isinstance(root, str) and os.path.isdir(root):
                    self._watch(root, store)
        if self.config.watch:
            self._watch_if_workspace()
        if self.config.watch and self.watcher is None:
            self.watcher = Watcher(
                roots=self.watched_roots, signature=self.unrecorded_signature,
                capture=lambda root, partial: self.capture(root, source="watch",
                                                           partial=partial),
                interval=self.config.watch_interval, max_wait=self.config.drift_max_wait,
                log=self.log, events=self.config.watch_events)
            self.watcher.start()
        return self.watcher

    def _watch_if_workspace(self):
        """Watch the working folder from the start when it is a workspace
        root with an active task in its store (clients start a server in the
        project). Nothing here may stop a server from starting."""
        try:
            root = os.path.realpath(os.getcwd())  # (a deleted folder has none)
            store_dir = self.workspaces.store_dir_for(root)
            if os.path.isdir(store_dir):
                store = self.workspaces.store(store_dir)
                if store.read_current().get(root):
                    self._watch(root, store)
        except (CheckpointError, OSError):
            pass

    def stop_watcher(self):
        if self.watcher:
            self.watcher.stop()

    def watched_roots(self):
        with self._lock:
            return list(self._watched)

    def _watch(self, root, store):
        with self._lock:
            self._watched[root] = store.directory

    def _keep_to_budget(self, ws):
        """The budget pass after a record was written, when TC_STORE_BUDGET
        is set (so that its cost is paid only then). The record stands
        whatever happens here: a failure is logged, never the call's."""
        if not self.config.store_budget:
            return
        try:
            self.compaction.keep_to_budget(ws)
        except (CheckpointError, OSError) as exc:
            self.log("TC_STORE_BUDGET: the budget pass did not finish (%s); the next record "
                     "tries again" % exc)

    def _reset_watcher(self, ws):
        if self.watcher:
            self.watcher.reset(ws.root)

    def _recorded(self, ws):
        """After a call that recorded the workspace: watched from now on, and
        whatever change the watcher was waiting on is recorded already."""
        self._watch(ws.root, ws.store)
        self._reset_watcher(ws)
