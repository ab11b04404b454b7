"""``edge-gateway passwd``: add, update or delete a user of a Mosquitto password file (``mosquitto_passwd(1)``).

The parser and the command live here so that :mod:`gateway.cli` only registers them.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import TextIO

from gateway.auth.passwd import DEFAULT_ITERATIONS, PasswordFile, PasswordFileError

DESCRIPTION = f"""\
Add a user to a password file, change a user's password, or delete a user.

The file is Mosquitto's format, one "user:$7$..." line per user: PBKDF2-SHA512 with
{DEFAULT_ITERATIONS} iterations and a 12-byte random salt, as mosquitto_passwd 2.0 writes. Mosquitto's
password_file reads it, mosquitto_passwd can edit it, and entries made by mosquitto_passwd (also the
older "$6$" ones of -H sha512) are kept as they are. Comments and blank lines are kept.

The file is replaced atomically (a broker reloading it on SIGHUP sees the old or the new file, never
half of one). A new file is created with mode 0600; a replaced one keeps its owner, group and mode
(at most 0640: never group-writable or readable by others), so a file deployed 0640
root:edge-gateway stays readable by the broker.
"""

EPILOG = """\
The password comes from, in this order:
  -b FILE USER PASSWORD   the command line (visible in ps and in your shell history: scripts only)
  --password-stdin        the first line of standard input (for scripts and secrets managers)
  a prompt                asked twice, not echoed, when standard input is a terminal

Examples:
  edge-gateway passwd -c /etc/edge-gateway/passwd alice     create the file with user alice (prompts)
  edge-gateway passwd /etc/edge-gateway/passwd bob          add bob, or change bob's password
  vault kv get -field=pw secret/gw/carol | \\
    edge-gateway passwd --password-stdin /etc/edge-gateway/passwd carol
  edge-gateway passwd -D /etc/edge-gateway/passwd bob       delete bob
  mosquitto_pub -u alice -P '...' -t test -m hi            log in with it

User names must not contain ':' and must not be empty (as mosquitto_passwd). Passwords must not be
empty either (unlike mosquitto_passwd): the broker, like Mosquitto, takes a zero-length password for
none, so such a user could never connect. Exit status: 0 done, 1 the file could not be read or written,
the password is empty or the user to delete is not in it, 2 wrong usage.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``passwd`` on the ``edge-gateway`` subcommand parser."""
    p = sub.add_parser(
        "passwd",
        help="add, update or delete a user in a Mosquitto password file",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-c", dest="create", action="store_true", help="create a new file (replaces an existing one!)")
    p.add_argument("-D", dest="delete", action="store_true", help="delete USER instead of setting a password")
    p.add_argument("-b", dest="batch", action="store_true", help="batch mode: the password is the third argument")
    p.add_argument("--password-stdin", action="store_true", help="read the password from the first line of stdin")
    p.add_argument("file", metavar="FILE", help="the password file")
    p.add_argument("username", metavar="USER", help="the user name")
    p.add_argument("password", metavar="PASSWORD", nargs="?", help="the password, with -b only")
    p.set_defaults(func=run)
    return p


def _fail(message: str, code: int = 1) -> int:
    print(f"edge-gateway passwd: {message}", file=sys.stderr)
    return code


def _read_password(args: argparse.Namespace, stdin: TextIO) -> str:
    if args.batch:
        return str(args.password)
    if args.password_stdin:
        line = stdin.readline()
        return line[:-1] if line.endswith("\n") else line
    if not stdin.isatty():
        raise ValueError("standard input is not a terminal: give the password with --password-stdin (or -b)")
    first = getpass.getpass("Password: ")
    if first != getpass.getpass("Reenter password: "):
        raise ValueError("the passwords do not match")
    return first


def run(args: argparse.Namespace, stdin: TextIO | None = None) -> int:
    """Carry out ``edge-gateway passwd``; returns the exit status."""
    stdin = stdin if stdin is not None else sys.stdin
    if args.delete and (args.create or args.batch or args.password_stdin):
        return _fail("-D cannot be combined with -c, -b or --password-stdin", 2)
    if args.batch and args.password_stdin:
        return _fail("give the password with -b or with --password-stdin, not both", 2)
    if args.batch != (args.password is not None):
        return _fail("-b needs the password as the third argument, and a third argument needs -b", 2)
    if args.create:
        pf = PasswordFile(args.file)
    else:
        try:
            pf = PasswordFile.load(args.file)
        except PasswordFileError as exc:
            if not os.path.exists(args.file):
                return _fail(f"{args.file} does not exist (use -c to create it)")
            return _fail(str(exc))
    if args.delete:
        if not pf.delete(args.username):
            return _fail(f"user {args.username!r} is not in {args.file}")
        action = "deleted"
    else:
        try:
            password = _read_password(args, stdin)
            added = pf.set(args.username, password)
        except ValueError as exc:
            return _fail(str(exc))
        except (KeyboardInterrupt, EOFError):
            return _fail("cancelled")
        action = "added" if added else "updated"
    try:
        pf.save()
    except OSError as exc:
        return _fail(f"cannot write {args.file}: {exc.strerror or exc}")
    print(f"{action} user {args.username!r} in {args.file}")
    return 0
