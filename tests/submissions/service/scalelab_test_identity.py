"""A Jupyter identity provider for the Assess service tests: a table of tokens, one per user.

Why: the concurrency and restart tests need many students against ONE real Jupyter server. Jupyter's stock
provider names token users anonymously, so each test user gets its own token here, and the server (started with
``--ServerApp.identity_provider_class=scalelab_test_identity.TokenTableIdentityProvider``) sees requests
carrying that token as that user. A request without a known token is not authenticated (403), as with Jupyter's
own provider. JupyterHub plays this role in a real multi-user deployment.
"""

from jupyter_server.auth.identity import IdentityProvider, User
from traitlets import Dict


class TokenTableIdentityProvider(IdentityProvider):
    user_tokens = Dict(config=True, help="token → user name")

    def get_user(self, handler):
        token = self.get_token(handler)
        username = self.user_tokens.get(token) if token else None
        if username is None:
            return None
        handler._token_authenticated = True  # token requests are exempt from the XSRF cookie, as in Jupyter
        return User(username=username)
