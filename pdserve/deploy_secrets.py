"""`pdserve secrets --dir DIR`: make a deployment's secrets once (later runs keep them).

    DIR/cluster-token     the deployment token (--cluster-token-file of every process)
    DIR/redis-password    Redis's password (--redis-password-file of every process)
    DIR/redis.conf        `requirepass` for redis-server (its first argument)
    DIR/api-keys          with --api-key: one client API key (the gateway's --api-key-file)

Files are created 0600; with --redis-uid the Redis files are given to that user (the official
Redis image runs as uid 999), so Redis can read them and nobody else but root. This is what
docker-compose.yml's `secrets` service runs before anything else starts.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pdserve.flags import DefaultsFormatter


def _write(path: Path, text: str, uid: int | None = None) -> bool:
    """Create `path` 0600 with `text` unless it exists; True when it was made."""
    if path.exists():
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)
    return True


def make(directory: str | Path, redis_uid: int | None = None, api_key: bool = False
         ) -> list[str]:
    """The secrets in `directory` (made where missing); the names of those made now."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    made = []
    if _write(d / "cluster-token", secrets.token_urlsafe(32) + "\n"):
        made.append("cluster-token")
    if _write(d / "redis-password", secrets.token_urlsafe(24) + "\n", redis_uid):
        made.append("redis-password")
    password = (d / "redis-password").read_text(encoding="utf-8").strip()
    if _write(d / "redis.conf", f"requirepass {password}\n", redis_uid):
        made.append("redis.conf")
    if api_key and _write(d / "api-keys", "sk-pdserve-" + secrets.token_urlsafe(32) + "\n"):
        made.append("api-keys")
    return made


def register(sub) -> None:
    p = sub.add_parser(
        "secrets", help="make a deployment's token and Redis password (kept if present)",
        formatter_class=DefaultsFormatter,
        description="Create DIR/cluster-token, DIR/redis-password and DIR/redis.conf (0600) "
                    "unless they exist: what every process of a deployment reads with "
                    "--cluster-token-file and --redis-password-file, and redis-server's config.")
    p.add_argument("--dir", required=True, help="folder for the secrets")
    p.add_argument("--api-key", action="store_true",
                   help="also make DIR/api-keys: one client API key for the gateway's "
                        "--api-key-file (deploy/k8s expects it)")
    p.add_argument("--redis-uid", type=int, default=None,
                   help="give the Redis files to this user id (the Redis image's is 999)")
    p.set_defaults(target="pdserve.deploy_secrets:main")


def main(args) -> int:
    made = make(args.dir, args.redis_uid, args.api_key)
    print(f"secrets in {args.dir}: " + (f"made {', '.join(made)}" if made else
                                        "all present, kept"))
    return 0
