package publish

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// refusedError is a connection the server (or the TLS handshake) refused
// for a reason that retrying cannot cure. Its text says what was sent and
// what to check; it matches ErrAuth, ErrTLS for a TLS problem, and the
// library's own error.
type refusedError struct {
	msg   string
	kinds []error
	cause error
}

func (e *refusedError) Error() string { return e.msg + " (" + e.cause.Error() + ")" }

func (e *refusedError) Unwrap() []error { return append(append([]error{}, e.kinds...), e.cause) }

// refusal explains a connect error that waiting will not cure, or returns
// nil for one that it may (the server is down, say).
func refusal(err error, cfg ConnectOptions) error {
	if reason := authReason(err); reason != "" {
		return &refusedError{msg: reason + ": " + credentialsRefused(cfg), kinds: []error{ErrAuth}, cause: err}
	}
	if advice, ok := tlsAdvice(err, cfg); ok {
		return &refusedError{msg: "TLS handshake failed: " + advice, kinds: []error{ErrTLS, ErrAuth}, cause: err}
	}
	if fatalConnectError(err) {
		return &refusedError{msg: "nats refused the connection", kinds: []error{ErrAuth}, cause: err}
	}
	return nil
}

// authReason names the server's refusal of the credentials, or "".
func authReason(err error) string {
	switch {
	case errors.Is(err, nats.ErrAuthExpired):
		return "authentication expired"
	case errors.Is(err, nats.ErrAuthRevoked):
		return "authentication revoked"
	case errors.Is(err, nats.ErrAccountAuthExpired):
		return "account authentication expired"
	case errors.Is(err, nats.ErrAuthorization), strings.Contains(strings.ToLower(err.Error()), "authorization violation"):
		return "authorization violation"
	}
	return ""
}

// credentialsRefused says which credential the connection sent, where it
// was set, and what to check. nats.go sends the user or token of a server
// URL in place of nats.user, nats.token and nats.nkey.
func credentialsRefused(cfg ConnectOptions) string {
	if u := urlUser(cfg.URLs); u != nil {
		what := "the token in nats.url"
		if _, ok := u.Password(); ok {
			what = fmt.Sprintf("user %q and the password in nats.url", u.Username())
		}
		return fmt.Sprintf("the server refused %s (from %s); check them, and percent-encode any '/', '#', '?' or ',' in them", what, cfg.from("nats.url"))
	}
	switch {
	case cfg.Creds != "":
		return fmt.Sprintf("the server refused %s (from %s); check that the server trusts its account and operator, and that it has not expired or been revoked", credsUser(cfg.Creds), cfg.from("nats.creds"))
	case cfg.NKey != "":
		return fmt.Sprintf("the server refused %s (from %s); check that the server's authorization lists that public key", nkeyUser(cfg.NKey), cfg.from("nats.nkey"))
	case cfg.Token != "":
		return fmt.Sprintf("the server refused the token (from %s); check it against the server's authorization token", cfg.from("nats.token"))
	case cfg.User != "" && cfg.Password == "":
		return fmt.Sprintf("the server refused user %q (from %s) with no password; set nats.password", cfg.User, cfg.from("nats.user"))
	case cfg.User != "":
		return fmt.Sprintf("the server refused user %q (from %s) with its password (from %s); check both against the server's authorization", cfg.User, cfg.from("nats.user"), cfg.from("nats.password"))
	case cfg.TLS.Cert != "":
		return fmt.Sprintf("no credentials were sent besides the client certificate %s (from %s), and the server maps no user to it; set nats.creds, nats.nkey, nats.token or nats.user and nats.password, or nats.context for a natscli context", cfg.TLS.Cert, cfg.from("nats.tls.cert"))
	}
	return "no credentials were sent; set nats.creds, nats.nkey, nats.token or nats.user and nats.password, or nats.context for a natscli context"
}

// urlUser returns the user information of the first server URL that has
// one.
func urlUser(urls string) *url.Userinfo {
	for _, s := range strings.Split(urls, ",") {
		if u, err := url.Parse(strings.TrimSpace(s)); err == nil && u.User != nil {
			return u.User
		}
	}
	return nil
}

// credsUser describes the user of a .creds file: its name, public key,
// account and expiry, none of them secret.
func credsUser(path string) string {
	desc := "the user JWT in " + path
	data, err := os.ReadFile(path)
	if err != nil {
		return desc
	}
	token, err := jwt.ParseDecoratedJWT(data)
	if err != nil {
		return desc
	}
	uc, err := jwt.DecodeUserClaims(token)
	if err != nil {
		return desc
	}
	desc = fmt.Sprintf("user %q (%s", uc.Name, uc.Subject)
	if uc.IssuerAccount != "" {
		desc += " of account " + uc.IssuerAccount
	}
	if uc.Expires > 0 {
		exp := time.Unix(uc.Expires, 0).UTC()
		verb := "expires"
		if exp.Before(time.Now()) {
			verb = "expired"
		}
		desc += fmt.Sprintf(", %s %s", verb, exp.Format(time.RFC3339))
	}
	return desc + ") of the credentials file " + path
}

// nkeyUser describes the user of an NKey seed file by its public key.
func nkeyUser(path string) string {
	desc := "the NKey user whose seed is in " + path
	data, err := os.ReadFile(path)
	if err != nil {
		return desc
	}
	kp, err := nkeys.ParseDecoratedNKey(data)
	if err != nil {
		return desc
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return desc
	}
	return fmt.Sprintf("NKey user %s (seed %s)", pub, path)
}

// tlsAdvice says what a TLS failure means and what to check, and whether
// err is one.
func tlsAdvice(err error, cfg ConnectOptions) (string, bool) {
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	msg := strings.ToLower(err.Error())
	ca := "the system's CAs"
	if cfg.TLS.CA != "" {
		ca = cfg.TLS.CA
		if from := cfg.from("nats.tls.ca"); from != "nats.tls.ca" {
			ca += " from " + from
		}
	}
	switch {
	case errors.As(err, &unknown):
		return fmt.Sprintf("the server's certificate is not signed by a CA the relay trusts (now %s); set nats.tls.ca to the CA that signed it", ca), true
	case errors.As(err, &host):
		return "the server's certificate is not valid for the name in nats.url; connect by a name the certificate lists, or have the certificate reissued with this one", true
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return "the server's certificate has expired or is not valid yet; check the certificate's dates and both clocks", true
	case errors.As(err, &invalid):
		return fmt.Sprintf("the server's certificate is not valid for a TLS server; check it against nats.tls.ca (now %s)", ca), true
	case errors.Is(err, nats.ErrSecureConnWanted):
		return "the relay asked for TLS (a tls:// URL or nats.tls settings) and the server does not offer it; use nats:// or enable TLS on the server", true
	case errors.Is(err, nats.ErrSecureConnRequired):
		return "the server requires TLS; use a tls:// URL and set nats.tls.ca", true
	case strings.Contains(msg, "certificate required"):
		return "the server requires a client certificate; set nats.tls.cert and nats.tls.key", true
	case strings.Contains(msg, "remote error: tls:") && cfg.TLS.Cert != "":
		return fmt.Sprintf("the server refused the client certificate %s (from %s); it must be signed by a CA the server trusts for clients", cfg.TLS.Cert, cfg.from("nats.tls.cert")), true
	case strings.Contains(msg, "closed by remote after tls handshake") && cfg.TLS.Cert == "":
		// The server's alert saying why is lost when the client writes
		// first: the usual reason is a client certificate it requires.
		return "the server closed the connection after the TLS handshake, as it does when it requires a client certificate; set nats.tls.cert and nats.tls.key", true
	case strings.Contains(msg, "closed by remote after tls handshake"):
		return fmt.Sprintf("the server closed the connection after the TLS handshake, as it does when it refuses the client certificate %s (from %s); it must be signed by a CA the server trusts for clients", cfg.TLS.Cert, cfg.from("nats.tls.cert")), true
	case strings.Contains(msg, "first record does not look like a tls handshake") && cfg.TLS.HandshakeFirst:
		return "the server does not expect TLS before the NATS handshake; unset nats.tls.handshake_first (or set handshake_first on the server)", true
	case strings.Contains(msg, "x509") || strings.Contains(msg, "tls:") || strings.Contains(msg, "tls error") || strings.Contains(msg, "remote error"):
		return fmt.Sprintf("check nats.tls.ca (now %s), nats.tls.cert and nats.tls.key, and the server name in nats.url", ca), true
	}
	return "", false
}
