"""The credentials people paste into chats, as the redaction tests feed them to 05: each kind of
``eagle3nb.data.redact`` in the sentence a user would write around it.

None is real: every secret is built here from a seeded generator in its provider's shape (prefix, length,
alphabet), and its prefix is split in the source, so no secret scanner flags the repository. ``{s}`` in a case's
text is where its secret goes.
"""

from __future__ import annotations

import base64
import json
import random
import string
from dataclasses import dataclass

ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Case:
    kind: str  # the kind the redactor must count it as
    template: str  # the sentence around it; {s} is the secret
    secret: str

    @property
    def text(self) -> str:
        return self.template.replace("{s}", self.secret)

    @property
    def redacted(self) -> str:
        """The sentence as it must come out: the secret replaced by its marker, every other character kept."""
        return self.template.replace("{s}", f"[REDACTED:{self.kind}]")


def _rand(rng: random.Random, n: int, alphabet: str = ALNUM) -> str:
    """``n`` random characters of ``alphabet`` with a letter and a digit in it (as real tokens of that length
    almost always have), so the shape, not luck, decides."""
    body = [rng.choice(alphabet) for _ in range(n - 2)]
    letters = [c for c in alphabet if c.isalpha()] or ["a"]
    digits = [c for c in alphabet if c.isdigit()] or ["7"]
    return rng.choice(letters) + "".join(body) + rng.choice(digits)


def _b64url(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")


def corpus(seed: int = 0) -> list[Case]:
    """One or more cases per kind (the variants a user writes: upper case, headers, JSON, DSNs), fresh fakes per
    ``seed``."""
    r = random.Random(seed)
    up = string.ascii_uppercase + string.digits
    hexd = string.hexdigits.lower()[:16]
    pem = "-" * 5 + "BEGIN " + "RSA PRIVATE" + " KEY" + "-" * 5
    pem_end = "-" * 5 + "END " + "RSA PRIVATE" + " KEY" + "-" * 5
    key_block = "\n".join([pem, *(_rand(r, 64, ALNUM + "+/") for _ in range(4)), _rand(r, 24, ALNUM + "+/") + "==",
                           pem_end])
    jwt = ".".join(["ey" + _b64url({"alg": "HS256", "typ": "JWT"})[2:],
                    "ey" + _b64url({"sub": str(r.randrange(10**9)), "name": "A User", "iat": 1700000000})[2:],
                    _rand(r, 43, ALNUM + "-_")])
    pw = lambda n=14: _rand(r, n, ALNUM + "!*~^%$")  # noqa: E731
    return [
        Case("openai", "my key is {s}, why does it fail?", "sk" + "-proj-" + _rand(r, 48, ALNUM + "_-")),
        Case("openai", "OPENAI_API_KEY={s}", "sk" + "-" + _rand(r, 48)),
        Case("anthropic", "export ANTHROPIC_API_KEY={s}", "sk" + "-ant-api03-" + _rand(r, 86, ALNUM + "_-")),
        Case("stripe", "Stripe says the key {s} is invalid", "sk" + "_live_" + _rand(r, 24)),
        Case("stripe", "restricted key: {s}", "rk" + "_live_" + _rand(r, 24)),
        Case("stripe", "test mode uses {s} here", "sk" + "_test_" + _rand(r, 24)),
        Case("github", "git clone https://{s}@github.com/acme/app.git fails", "gh" + "p_" + _rand(r, 36)),
        Case("github", "token = {s}", "github" + "_pat_" + _rand(r, 22) + "_" + _rand(r, 59)),
        Case("github", "the app installation token {s} expired", "gh" + "s_" + _rand(r, 36)),
        Case("gitlab", "GITLAB_TOKEN: {s}", "gl" + "pat-" + _rand(r, 20)),
        Case("aws_access_key_id", "aws_access_key_id = {s}", "AK" + "IA" + _rand(r, 16, up)),
        Case("aws_access_key_id", "temporary creds {s} from STS", "AS" + "IA" + _rand(r, 16, up)),
        Case("aws_secret_key", "aws_secret_access_key = {s}", _rand(r, 40, ALNUM + "+/")),
        Case("google_api_key", "https://maps.example.com/api?key={s}&q=paris",
             "AI" + "za" + _rand(r, 35, ALNUM + "_-")),
        Case("google_oauth", "the oauth access token {s} expired", "ya" + "29." + _rand(r, 60, ALNUM + "_-")),
        Case("slack", "SLACK_BOT_TOKEN={s}", "xo" + "xb-" + _rand(r, 12, string.digits) + "-" +
             _rand(r, 13, string.digits) + "-" + _rand(r, 24)),
        Case("slack_webhook", "post to {s} when the job is done", "https://hooks.slack.com/services/T" +
             _rand(r, 8, up) + "/B" + _rand(r, 8, up) + "/" + _rand(r, 24)),
        Case("huggingface", "huggingface-cli login --token {s}", "hf" + "_" + _rand(r, 34)),
        Case("npm", "//registry.npmjs.org/:_authToken={s}", "np" + "m_" + _rand(r, 36)),
        Case("pypi", "password = {s}", "py" + "pi-AgEIcHlwaS5vcmc" + _rand(r, 60, ALNUM + "_-")),
        Case("sendgrid", "SENDGRID_API_KEY='{s}'", "SG" + "." + _rand(r, 22, ALNUM + "_-") + "." +
             _rand(r, 43, ALNUM + "_-")),
        Case("groq", "GROQ_API_KEY={s}", "gs" + "k_" + _rand(r, 52)),
        Case("digitalocean", "doctl auth init -t {s}", "do" + "p_v1_" + _rand(r, 64, hexd)),
        Case("jwt", "Authorization: Bearer {s}", jwt),
        Case("private_key", "here is my deploy key:\n{s}\nwhy does ssh reject it?", key_block),
        Case("url_password", "DATABASE_URL=postgres://app:{s}@db.internal:5432/shop", pw(16)),
        Case("url_password", "mysql://root:{s}@localhost/test does not connect", pw(12)),
        Case("url_password", "REDIS_URL=redis://:{s}@cache:6379/0", pw(20)),
        Case("url_password", "mongodb+srv://admin:{s}@cluster0.example.net/?retryWrites=true", pw(16)),
        Case("password", "host=db port=5432 user=app password={s} dbname=shop", pw()),
        Case("password", "Server=tcp:sql.example.com;Database=shop;User Id=sa;Password={s};", pw()),
        Case("password", "Password: {s}", pw()),
        Case("password", "MYSQL_PWD={s} mysql -u root", pw()),
        Case("password", "passwd={s}", pw(10)),
        Case("password", '{"db_password": "{s}"}', pw()),
        Case("credential", "API_KEY={s}", _rand(r, 32)),
        Case("credential", "X-API-KEY: {s}", _rand(r, 32, hexd)),
        Case("credential", "my api key: {s} (please keep it safe)", _rand(r, 40)),
        Case("credential", '{"client_secret": "{s}"}', _rand(r, 32, ALNUM + "-_")),
        Case("credential", "SECRET_KEY = '{s}'", _rand(r, 50, ALNUM + "!@#%^*(-_=+)")),
        Case("credential", "auth: {s}", _rand(r, 24)),
        Case("authorization", "Authorization: Basic {s}", base64.b64encode(f"admin:{pw()}".encode()).decode()),
        Case("authorization", "authorization: token {s}", _rand(r, 40, hexd)),
        Case("bearer", "call it with the bearer {s} please", _rand(r, 32, ALNUM + "-_")),
        Case("high_entropy", "my token for the staging box is {s}", _rand(r, 32)),
        Case("high_entropy", "here is the secret, do not share: {s}", _rand(r, 28, ALNUM + "/+")),
    ]
