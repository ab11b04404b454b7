#!/usr/bin/env bash
# Prints the signing certificate, key and keyring of the update bundles, one path a line (image/build.sh puts the
# keyring into the image, image/rauc/bundle.sh signs with the certificate and key).
#
# The operator's: IMAGE_SIGNING_CERT and IMAGE_SIGNING_KEY (PEM; the key without a passphrase, or a PKCS#11 URI as
# RAUC takes it), IMAGE_KEYRING (the CA certificates a gateway accepts; default: the signing certificate itself).
# Without them a development key pair is made once under OUT/keys/ and used, with a warning on every use: bundles
# signed with it are accepted only by images built with it, and anyone with the build directory can sign.
set -euo pipefail
out=${1:?usage: keys.sh OUT_DIR}
if [ -n "${IMAGE_SIGNING_CERT:-}" ] || [ -n "${IMAGE_SIGNING_KEY:-}" ]; then
    [ -n "${IMAGE_SIGNING_CERT:-}" ] && [ -n "${IMAGE_SIGNING_KEY:-}" ] \
        || { echo "keys.sh: IMAGE_SIGNING_CERT and IMAGE_SIGNING_KEY go together" >&2; exit 2; }
    [ -r "$IMAGE_SIGNING_CERT" ] || { echo "keys.sh: IMAGE_SIGNING_CERT=$IMAGE_SIGNING_CERT is not readable" >&2; exit 2; }
    printf '%s\n%s\n%s\n' "$IMAGE_SIGNING_CERT" "$IMAGE_SIGNING_KEY" "${IMAGE_KEYRING:-$IMAGE_SIGNING_CERT}"
    exit 0
fi
dir=$out/keys
if [ ! -s "$dir/development.cert.pem" ]; then
    mkdir -p "$dir"
    chmod 0700 "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
        -subj "/O=edge-gateway development/CN=edge-gateway development update signing key" \
        -keyout "$dir/development.key.pem" -out "$dir/development.cert.pem" 2>/dev/null
fi
{
    echo "######################################################################################################"
    echo "# WARNING: update bundles are signed with the DEVELOPMENT key $dir/development.key.pem"
    echo "# (made by image/rauc/keys.sh, not secret). Field gateways need your own: IMAGE_SIGNING_CERT=... and"
    echo "# IMAGE_SIGNING_KEY=... (README \"Updating gateways in the field\")."
    echo "######################################################################################################"
} >&2
printf '%s\n%s\n%s\n' "$dir/development.cert.pem" "$dir/development.key.pem" "${IMAGE_KEYRING:-$dir/development.cert.pem}"
