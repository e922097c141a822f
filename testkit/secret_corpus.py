"""The credentials people paste into chats, as the redaction tests (tests/test_redact.py) and its benchmark
(benchmarks/bench_redact.py) feed them to 05: each kind of ``eagle3nb.data.redact`` in the sentence a user would
write around it; and ordinary texts that hold none (:data:`ORDINARY`), which must come out as they went in.

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


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def corpus(seed: int = 0) -> list[Case]:
    """One or more cases per kind (the variants a user writes: upper case, camelCase, headers, JSON, YAML, prose,
    DSNs, signed URLs, base64), fresh fakes per ``seed``."""
    r = random.Random(seed)
    up = string.ascii_uppercase + string.digits
    hexd = string.hexdigits.lower()[:16]
    uuid = "-".join(_rand(r, n, hexd) for n in (8, 4, 4, 4, 12))
    bech32 = "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L"
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
        # the shapes the security review found passing (issue 50): names in camelCase and glued, Kubernetes entries,
        # prose, cloud connection strings and signed URLs, more providers, encodings, short and upper-cased keys
        Case("password", "dbPassword={s}", pw()),
        Case("credential", '{"sessionToken": "{s}"}', _rand(r, 32)),
        Case("credential", "const accountKey = '{s}';", _rand(r, 40)),
        Case("password", "PGPASSWORD={s} psql -h db -U app shop", pw()),
        Case("password", '{"name": "DB_PASSWORD", "value": "{s}"}', pw()),
        Case("credential", "env:\n- name: STRIPE_TOKEN\n  value: {s}\n- name: LOG_LEVEL\n  value: info",
             _rand(r, 32)),
        Case("credential", "HEROKU_API_KEY is {s}, is that the right format?", uuid),
        Case("password", "my password is {s}, can you see why the login fails?", _rand(r, 9)),
        Case("password", "passcode: {s}", _digits(r, 6)),
        Case("azure_storage_key", "DefaultEndpointsProtocol=https;AccountName=acme;AccountKey={s};"
             "EndpointSuffix=core.windows.net", _rand(r, 86, ALNUM + "+/") + "=="),
        Case("azure_sas", "https://acme.blob.core.windows.net/data/x.csv?sv=2022-11-02&ss=b&sp=r"
             "&se=2026-01-01T00:00:00Z&sig={s} returns 403", _rand(r, 43) + "%3D"),
        Case("azure_client_secret", "AZURE_CLIENT_SECRET={s}",
             _rand(r, 3) + _digits(r, 1) + "Q~" + _rand(r, 34, ALNUM + "_~.-")),
        Case("aws_signed_url", "curl 'https://b.s3.amazonaws.com/k.zip?X-Amz-Algorithm=AWS4-HMAC-SHA256"
             "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=900&X-Amz-SignedHeaders=host&X-Amz-Signature={s}'",
             _rand(r, 64, hexd)),
        Case("gcp_signed_url", "https://storage.googleapis.com/b/o.csv?X-Goog-Algorithm=GOOG4-RSA-SHA256"
             "&X-Goog-Expires=900&X-Goog-Signature={s} expired", _rand(r, 128, hexd)),
        Case("webhook_secret", "STRIPE_WEBHOOK_SECRET={s}", "wh" + "sec_" + _rand(r, 32)),
        Case("twilio", "the twilio key {s} stopped working", "S" + "K" + _rand(r, 32, hexd)),
        Case("discord", "the bot logs in with {s} on start",
             "M" + _rand(r, 25) + "." + _rand(r, 6) + "." + _rand(r, 38, ALNUM + "_-")),
        Case("discord_webhook", "post alerts to {s} please", "https://discord.com/api/" + "webhooks/" +
             _digits(r, 18) + "/" + _rand(r, 68, ALNUM + "_-")),
        Case("teams_webhook", "the teams hook {s} returns 400", "https://acme.webhook." + "office.com/webhookb2/" +
             uuid + "/IncomingWebhook/" + _rand(r, 32, hexd) + "/" + uuid),
        Case("telegram", "curl https://api.telegram.org/bot{s}/getMe",
             _digits(r, 10) + ":AA" + _rand(r, 33, ALNUM + "_-")),
        Case("base64", "echo {s} | base64 -d", base64.b64encode(f"api_key={_rand(r, 32)}".encode()).decode()),
        Case("base64", "the config blob is {s}", base64.urlsafe_b64encode(
            json.dumps({"db_password": pw()}).encode()).decode().rstrip("=")),
        Case("openai", "THE KEY IS {s}", ("sk" + "-proj-" + _rand(r, 48)).upper()),
        Case("openai", "the proxy's master key {s} is rejected", "sk" + "-" + _rand(r, 10)),
        Case("docker", "docker login -u acme -p {s}", "dckr" + "_pat_" + _rand(r, 27, ALNUM + "_-")),
        Case("vault", "VAULT_TOKEN={s}", "hv" + "s." + _rand(r, 90, ALNUM + "_-")),
        Case("databricks", "DATABRICKS_TOKEN={s}", "da" + "pi" + _rand(r, 32, hexd)),
        Case("shopify", "X-Shopify-Access-Token: {s}", "shp" + "at_" + _rand(r, 32, hexd)),
        Case("linear", "LINEAR_API_KEY={s}", "lin" + "_api_" + _rand(r, 40)),
        Case("perplexity", "PPLX_API_KEY={s}", "pp" + "lx-" + _rand(r, 48)),
        Case("xai", "XAI_API_KEY={s}", "xa" + "i-" + _rand(r, 80)),
        Case("replicate", "REPLICATE_API_TOKEN={s}", "r" + "8_" + _rand(r, 37)),
        Case("square", "SQUARE_ACCESS_TOKEN={s}", "sq0" + "atp-" + _rand(r, 22, ALNUM + "_-")),
        Case("mailgun", "mailgun says {s} is not valid", "ke" + "y-" + _rand(r, 32, hexd)),
        Case("mailchimp", "MAILCHIMP_KEY={s}", _rand(r, 32, hexd) + "-us" + _digits(r, 2)),
        Case("sentry", "SENTRY_AUTH_TOKEN={s}", "sntry" + "s_" + _rand(r, 60, ALNUM + "_-")),
        Case("grafana", "GRAFANA_TOKEN={s}", "gl" + "sa_" + _rand(r, 32) + "_" + _rand(r, 8, hexd)),
        Case("newrelic", "NEW_RELIC_API_KEY={s}", "NR" + "AK-" + _rand(r, 27, up)),
        Case("postman", "POSTMAN_API_KEY={s}", "PM" + "AK-" + _rand(r, 24, hexd) + "-" + _rand(r, 34, hexd)),
        Case("age", "age identity {s} in keys.txt", "AGE-SECRET" + "-KEY-1" + "".join(
            r.choice(bech32) for _ in range(58))),
        Case("pulumi", "PULUMI_ACCESS_TOKEN={s}", "pu" + "l-" + _rand(r, 40, hexd)),
        Case("supabase", "SUPABASE_ACCESS_TOKEN={s}", "sb" + "p_" + _rand(r, 40, hexd)),
        Case("planetscale", "PLANETSCALE_SERVICE_TOKEN={s}", "pscale" + "_tkn_" + _rand(r, 43, ALNUM + "_")),
        Case("artifactory", "pull it with {s} from the mirror", "AK" + "Cp" + _rand(r, 69)),
    ]


# Texts that hold no secret though they look close to one: credential words in code and prose, placeholders, paths,
# ids, hashes, encodings. The trade-off they pin: a value after a credential name is redacted when it holds a digit or
# a symbol (8+ characters; a password: any value but code), so these stay, and a UUID or a hash stays unless a
# credential word stands right before it.
ORDINARY = [
    "The key: understand recursion before you start.",
    "Set max_tokens=4096 and temperature=0.7 in the request.",
    "Token: end of sequence",
    "the author: Jane Austen",
    "Your password must be at least 8 characters long.",
    'a dict like {"key": "Enter", "token_count": 12}',
    "sort by key=lambda x: x[1]",
    "The bearer of bad news arrived at the internationalization meeting.",
    "sha256 of the file is 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "request id 123e4567-e89b-12d3-a456-426614174000",
    "https://user@example.com/path and http://localhost:8000/v1/chat/completions",
    "ssh://git@github.com:22/acme/app.git",
    "def tokenize(text): return text.split()",
    "x = a_key + b_token; y = tokens[-1]; monkey=banana",
    "Use the access token from the settings page.",
    # code that names keys and tokens without holding one
    "value = cache.get(key)\nkey = dict.get(name, default)\nif key in seen: continue",
    "api_key = os.environ[\"OPENAI_API_KEY\"]\ntoken = os.getenv('HF_TOKEN')\nsecret = settings.SECRET_KEY",
    "const apiKey = process.env.API_KEY; const sortKey = item.sortKey;",
    "headers = {\"Authorization\": f\"Bearer {token}\"}",
    "password: ${DB_PASSWORD}\napi_key: <your api key>\ntoken: YOUR_TOKEN_HERE\nPassword: ********",
    "login(username=user, password=pwd)\nself.password = password",
    "ssl_key: /etc/ssl/private/server.key\nkey_file: ./certs/client.key\npublic_key: ssh-ed25519 AAAAC3Nza",
    '[{"key": "Content-Type", "value": "application/json"}, {"key": "Accept", "value": "text/html"}]',
    "env:\n- name: DB_PASSWORD\n  valueFrom:\n    secretKeyRef:\n      name: db\n      key: password",
    "token_limit: 100000\nmax_password_length: 64\ncache_key: user-42-profile\ntoken_type: Bearer",
    # prose around credentials, keys and tokens
    "The key point is that the cache must be warm before the first request.",
    "The password is incorrect, and my password is too long for the form.",
    "The key is to practice every day; the secret is consistency.",
    "Our access token expires in 3600 seconds; the refresh token lasts 30 days.",
    "auth: required, auth: OAuth2, authentication: enabled",
    "The Authorization header must be set on every call.",
    "A primary key, a foreign key and a sort key are different things.",
    "Tokens: 4096 of 8192 used. The tokenizer splits words into tokens.",
    # ids, hashes, numbers and encodings that are not secrets
    'trace {"request_id": "0b6f3c1e-9a4d-4c6e-8f2a-7d1e5b9c3a10", '
    '"idempotency_key": "3f2c9e1a-5b7d-4e8f-a1c3-9d2b6e4f8a07"}',
    "commit 3a9f1c2e8b7d6a5f4e3d2c1b0a9f8e7d6c5b4a39 fixed it; see PR #4821 from 2024-06-01",
    "The image is data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA"
    "60e6kgAAAABJRU5ErkJggg==",
    "echo SGVsbG8sIHdvcmxkISBIb3cgYXJlIHlvdT8= | base64 -d",
    "the risk-free rate, task-1234, SK Telecom and sk-learn are not keys",
    "Color #1a2b3c, version v1.2.3, build 20240601.1, port 5432, ISBN 978-3-16-148410-0",
    "See https://example.com/search?q=python&page=2&sort=desc for more.",
    "internationalizationinternationalization and pneumonoultramicroscopicsilicovolcanoconiosis",
]
