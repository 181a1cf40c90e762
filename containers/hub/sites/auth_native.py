"""NativeAuthenticator: Hub passwords of their own, chosen at sign-up, each sign-up approved by a Hub admin.

A jupyterhub_config.d-style fragment: it expects `c` and overrides what containers/hub/jupyterhub_config.py set.
Not tested here: `make hub` is tested with PAM only. Needs jupyterhub-nativeauthenticator==1.3.0 in the Hub's
environment; see sites/README.md.

Native creates no system account: root still creates every student's and instructor's with `scalelab class
add-student NAME` / `add-instructor NAME`, and the person signs up with exactly that NAME. Instructors are who
root added with add-instructor (the Unix group scalelab-instructors), made the Hub group `instructors` at each
login, as jupyterhub_config.py does for PAM.
"""

import os

import nativeauthenticator
from tornado import web

# --- this site --------------------------------------------------------------------------------------------------
# Who approves sign-ups at /hub/authorize: a Hub admin, who can also open every student's server. Give it to one
# instructor's account (it signs up like everyone else, and is approved at once).
HUB_ADMINS = {"carol"}

# `c`: the config being loaded. Every loader of such files defines it: JupyterHub's, make hub's HUB_CONFIG_D,
# TLJH's load_subconfig, and the Helm chart's exec of hub.extraConfig (z2jh, where get_config is a function of
# its own).

c.JupyterHub.authenticator_class = "native"
# Native's login page carries the sign-up link.
c.JupyterHub.template_paths = [os.path.join(os.path.dirname(nativeauthenticator.__file__), "templates")]
c.NativeAuthenticator.open_signup = False  # every sign-up waits for an admin's approval
# Native logs in only approved users; JupyterHub 5 also wants an allow rule, and this is it.
c.NativeAuthenticator.allow_all = True
c.NativeAuthenticator.minimum_password_length = 10
c.NativeAuthenticator.check_common_password = True
c.NativeAuthenticator.allowed_failed_logins = 5  # then a wait of seconds_before_next_try (600 s)
c.Authenticator.admin_users = HUB_ADMINS


def class_member(authenticator, handler, authentication):
    """Only a class account (`scalelab class add-*`) can start a server; its Unix group makes an instructor."""
    from scalelab.grader.classroom.accounts import HUB_INSTRUCTORS_GROUP, ROLE_GROUPS, in_group, role_of

    name = authentication["name"]
    if role_of(name) is None:
        raise web.HTTPError(403, f"{name} has no account in this class on the server: ask an instructor to run "
                                 f"`scalelab class add-student {name}` as root.")
    authentication["groups"] = [HUB_INSTRUCTORS_GROUP] if in_group(name, ROLE_GROUPS["instructor"]) else []
    return authentication


c.Authenticator.manage_groups = True
c.Authenticator.post_auth_hook = class_member
