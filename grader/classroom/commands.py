"""``scalelab class``: the command line of the class's accounts (accounts.py) and of its assessment scores in
nbgrader's gradebook (gradebook.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import gradebook
from .accounts import (DEFAULT_HUB_STATE, EXIT_OK, HUB_STATE_VARIABLE, ROLE_GROUPS, ClassError, add_member, members,
                       remove_member)


def add_command(role: str):
    def command(args: argparse.Namespace) -> int:
        password = None
        if args.password_stdin:
            password = sys.stdin.readline().rstrip("\n")
        try:
            print(add_member(args.name, role, password))
        except ClassError as error:
            print(f"scalelab class: {error}", file=sys.stderr)
            return error.exit_code
        return EXIT_OK
    return command


def remove_command(args: argparse.Namespace) -> int:
    hub_state = Path(args.hub_state or os.environ.get(HUB_STATE_VARIABLE) or DEFAULT_HUB_STATE)
    try:
        print(remove_member(args.name, hub_state))
    except ClassError as error:
        print(f"scalelab class: {error}", file=sys.stderr)
        return error.exit_code
    return EXIT_OK


def list_command(args: argparse.Namespace) -> int:
    rows = members()
    if not rows:
        print("nobody is in the class yet: sudo scalelab class add-student NAME")
        return EXIT_OK
    print(f"{'name':<33} {'role':<11} account")
    for name, role, exists in rows:
        print(f"{name:<33} {role:<11} {'exists' if exists else 'missing'}")
    return EXIT_OK


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "class", help="the accounts of a class on one server (make hub), and its assessment scores in nbgrader",
        description="Students and instructors of a class served by `make hub`, and the assessment's scores in "
                    "nbgrader's gradebook. Exit codes: 0 done (or nothing to do); 1 a system tool failed; 2 a bad "
                    "name or password; 3 the name is another account's or has the other role; 4 not root "
                    "(gradebook: see its --help).")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    for role in ROLE_GROUPS:
        article = "an" if role == "instructor" else "a"
        add = actions.add_parser(f"add-{role}", help=f"create the system account of {article} {role} (as root)")
        add.add_argument("name", metavar="NAME")
        add.add_argument("--password-stdin", action="store_true",
                         help="read the password from the first line of standard input (default: print a generated "
                              "one, once)")
        add.set_defaults(func=add_command(role))
    remove = actions.add_parser("remove", help="take a student or instructor out of the class at once (as root): "
                                               "no login, server stopped, tokens revoked; the home is kept")
    remove.add_argument("name", metavar="NAME")
    remove.add_argument("--hub-state", default=None, metavar="DIR",
                        help=f"the Hub's state folder (default: ${HUB_STATE_VARIABLE}, else {DEFAULT_HUB_STATE})")
    remove.set_defaults(func=remove_command)
    show = actions.add_parser("list", help="name, role and whether the account exists, for everyone in the class")
    show.set_defaults(func=list_command)
    gradebook.register(actions)
