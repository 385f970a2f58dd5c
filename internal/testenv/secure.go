package testenv

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
)

// TLSFiles are PEM files for a test PKI: a CA, a server certificate for
// 127.0.0.1 and localhost, a client certificate, all signed by the CA, and
// an unrelated CA that signed nothing here.
type TLSFiles struct {
	CA, ServerCert, ServerKey, ClientCert, ClientKey, OtherCA string
}

// NewTLSFiles generates the PKI under a temporary directory.
func NewTLSFiles(t testing.TB) TLSFiles {
	t.Helper()
	dir := t.TempDir()
	ca, caKey := newCert(t, nil, nil, "outbox-relay test CA", true)
	other, _ := newCert(t, nil, nil, "some other CA", true)
	srv, srvKey := newCert(t, ca, caKey, "nats server", false)
	cli, cliKey := newCert(t, ca, caKey, "outbox-relay client", false)
	f := TLSFiles{
		CA: filepath.Join(dir, "ca.pem"), OtherCA: filepath.Join(dir, "other-ca.pem"),
		ServerCert: filepath.Join(dir, "server.pem"), ServerKey: filepath.Join(dir, "server-key.pem"),
		ClientCert: filepath.Join(dir, "client.pem"), ClientKey: filepath.Join(dir, "client-key.pem"),
	}
	writePEM(t, f.CA, "CERTIFICATE", ca.Raw)
	writePEM(t, f.OtherCA, "CERTIFICATE", other.Raw)
	writePEM(t, f.ServerCert, "CERTIFICATE", srv.Raw)
	writePEM(t, f.ClientCert, "CERTIFICATE", cli.Raw)
	writeKey(t, f.ServerKey, srvKey)
	writeKey(t, f.ClientKey, cliKey)
	return f
}

// ServerTLS configures a server for TLS with these files; with
// verifyClients it requires a client certificate signed by the CA.
func (f TLSFiles) ServerTLS(verifyClients, handshakeFirst bool) func(*server.Options) {
	return func(o *server.Options) {
		cfg, err := server.GenTLSConfig(&server.TLSConfigOpts{CertFile: f.ServerCert, KeyFile: f.ServerKey, CaFile: f.CA, Verify: verifyClients})
		if err != nil {
			panic(fmt.Sprintf("server TLS config: %v", err))
		}
		o.TLSConfig, o.TLSVerify, o.TLSTimeout, o.TLSHandshakeFirst = cfg, verifyClients, 2, handshakeFirst
	}
}

func newCert(t testing.TB, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, name string, isCA bool) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	if isCA {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage |= x509.KeyUsageCertSign
		tmpl.DNSNames, tmpl.IPAddresses, tmpl.ExtKeyUsage = nil, nil, nil
	}
	signer, signKey := tmpl, key
	if parent != nil {
		signer, signKey = parent, parentKey
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, signer, &key.PublicKey, signKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

func writeKey(t testing.TB, path string, key *ecdsa.PrivateKey) {
	t.Helper()
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, path, "EC PRIVATE KEY", der)
}

// ClientTLS is a client configuration trusting only caFile.
func ClientTLS(t testing.TB, caFile string) *tls.Config {
	t.Helper()
	pool := x509.NewCertPool()
	raw, err := os.ReadFile(caFile)
	if err != nil || !pool.AppendCertsFromPEM(raw) {
		t.Fatalf("read CA %s: %v", caFile, err)
	}
	return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
}

// NKeyUser returns the seed file of a new user NKey and the server option
// that admits it (with publish and subscribe on everything).
func NKeyUser(t testing.TB) (seedFile string, configure func(*server.Options)) {
	t.Helper()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	pub, _ := kp.PublicKey()
	seedFile = filepath.Join(t.TempDir(), "user.nk")
	if err := os.WriteFile(seedFile, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	return seedFile, func(o *server.Options) { o.Nkeys = append(o.Nkeys, &server.NkeyUser{Nkey: pub}) }
}

// JWTAuth is decentralized authentication: an operator, an account with
// JetStream, and a user whose credentials are in CredsFile.
type JWTAuth struct {
	CredsFile string
	UserJWT   string // secrets a log must never show
	UserSeed  string
	Configure func(*server.Options)
}

// NewJWTAuth creates the operator, account and user, and the server
// options that trust them (an in-memory account resolver).
func NewJWTAuth(t testing.TB) JWTAuth {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	okp, err := nkeys.CreateOperator()
	must(err)
	opub, _ := okp.PublicKey()
	oc := jwt.NewOperatorClaims(opub)
	oc.Name = "test-operator"
	ojwt, err := oc.Encode(okp)
	must(err)
	operator, err := jwt.DecodeOperatorClaims(ojwt)
	must(err)

	// account creates an account signed by the operator; limits may
	// change its claims first.
	account := func(name string, limits func(*jwt.AccountClaims)) (kp nkeys.KeyPair, pub, token string) {
		kp, err := nkeys.CreateAccount()
		must(err)
		pub, _ = kp.PublicKey()
		claims := jwt.NewAccountClaims(pub)
		claims.Name = name
		if limits != nil {
			limits(claims)
		}
		token, err = claims.Encode(okp)
		must(err)
		return kp, pub, token
	}
	_, sysPub, sysJWT := account("SYS", nil)
	akp, apub, ajwt := account("APP", func(c *jwt.AccountClaims) {
		c.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	})

	ukp, _ := nkeys.CreateUser()
	upub, _ := ukp.PublicKey()
	uc := jwt.NewUserClaims(upub)
	uc.Name = "relay"
	uc.IssuerAccount = apub
	ujwt, err := uc.Encode(akp)
	must(err)
	useed, _ := ukp.Seed()
	creds, err := jwt.FormatUserConfig(ujwt, useed)
	must(err)
	credsFile := filepath.Join(t.TempDir(), "relay.creds")
	must(os.WriteFile(credsFile, creds, 0o600))

	return JWTAuth{
		CredsFile: credsFile, UserJWT: ujwt, UserSeed: string(useed),
		Configure: func(o *server.Options) {
			resolver := &server.MemAccResolver{}
			must(resolver.Store(apub, ajwt))
			must(resolver.Store(sysPub, sysJWT))
			o.TrustedOperators = []*jwt.OperatorClaims{operator}
			o.AccountResolver = resolver
			o.SystemAccount = sysPub
		},
	}
}
