package publish

// ConnectOptions are what Connect needs of a connection: the servers, the
// client's name, the credential to send and the TLS files. The files are
// read at each connection attempt, so that renewed certificates and
// credentials take effect.
type ConnectOptions struct {
	// URLs are the comma-separated server URLs. One may hold a user and
	// password, or a token, in place of the credentials below.
	URLs string
	// Name is the connection's name, as the server shows it.
	Name string

	// The credential sent, the first that is set of: a .creds file (user
	// JWT and NKey seed), an NKey seed file, a token, a user and password.
	Creds    string
	NKey     string
	Token    string
	User     string
	Password string

	TLS TLSOptions

	// Source says where the setting of a configuration key (nats.url,
	// nats.creds, nats.nkey, nats.token, nats.user, nats.password,
	// nats.tls.ca, nats.tls.cert, nats.tls.key) came from, such as
	// "NATS_CREDS" or "nats.creds in /etc/outbox-relay.yaml", for the
	// errors of a refused connection, which name it. Nil, or "" for a key,
	// names the key itself.
	Source func(key string) string
}

// TLSOptions configure the client side of a TLS connection.
type TLSOptions struct {
	CA                 string // file of the CAs that verify the server; empty: the system's
	Cert               string // file of the client certificate, sent when the server asks
	Key                string // file of the client certificate's key
	InsecureSkipVerify bool   // accept any server certificate
	HandshakeFirst     bool   // TLS before the NATS protocol, for a server that expects it
}

// from says where the setting key came from: its Source, else the key
// itself.
func (o ConnectOptions) from(key string) string {
	if o.Source != nil {
		if s := o.Source(key); s != "" {
			return s
		}
	}
	return key
}
