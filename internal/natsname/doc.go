// Package natsname holds NATS's naming rules as the relay applies them, in
// one place for the configuration, the relay loop, the NATS adapter and
// stream reconciliation: the subjects the relay publishes on, the subject
// filters of a stream and what they capture, stream and consumer names,
// and server URLs (checking them, and hiding the credentials they may
// hold in logs and errors). It imports only the standard library.
//
// Its errors say what is wrong with a value and leave naming the
// configuration key or the column it came from to the caller, except where
// the advice is about a key itself (percent-encode the password of
// nats.url, or set nats.user and nats.password instead).
package natsname
