package daemon

import (
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/publish"
)

// ConnectOptions returns the options of a connection named name to the
// servers of cfg.URL with the credentials and TLS files of cfg. A refused
// connection's errors name where each setting came from (cfg.From). A
// caller that connects elsewhere than cfg.URL (the embedded server, a
// bench's own) sets URLs.
func ConnectOptions(cfg config.NATS, name string) publish.ConnectOptions {
	return publish.ConnectOptions{
		URLs:     cfg.URL,
		Name:     name,
		Creds:    cfg.Creds,
		NKey:     cfg.NKey,
		Token:    cfg.Token,
		User:     cfg.User,
		Password: cfg.Password,
		TLS: publish.TLSOptions{
			CA:                 cfg.TLS.CA,
			Cert:               cfg.TLS.Cert,
			Key:                cfg.TLS.Key,
			InsecureSkipVerify: cfg.TLS.InsecureSkipVerify,
			HandshakeFirst:     cfg.TLS.HandshakeFirst,
		},
		Source: cfg.From,
	}
}
