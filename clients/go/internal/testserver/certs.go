package testserver

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Certs are the PEM files of a throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1 and
// localhost, a client certificate (mutual TLS), and a second CA that signed nothing the server trusts.
type Certs struct {
	CACert, ServerCert, ServerKey, ClientCert, ClientKey string
	OtherCACert, OtherClientCert, OtherClientKey         string
}

type keyPair struct {
	cert *x509.Certificate
	der  []byte
	key  *ecdsa.PrivateKey
}

// WriteCerts generates the PKI into dir. The certificates are valid for one day.
func WriteCerts(dir string) (*Certs, error) {
	ca, err := newCert(nil, &x509.Certificate{
		Subject: pkix.Name{CommonName: "engine test CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	})
	if err != nil {
		return nil, err
	}
	otherCA, err := newCert(nil, &x509.Certificate{
		Subject: pkix.Name{CommonName: "untrusted CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	})
	if err != nil {
		return nil, err
	}
	server, err := newCert(ca, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "localhost"},
		DNSNames:    []string{"localhost"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	})
	if err != nil {
		return nil, err
	}
	clientTemplate := func() *x509.Certificate {
		return &x509.Certificate{
			Subject:     pkix.Name{CommonName: "engine test client"},
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		}
	}
	client, err := newCert(ca, clientTemplate())
	if err != nil {
		return nil, err
	}
	otherClient, err := newCert(otherCA, clientTemplate())
	if err != nil {
		return nil, err
	}
	c := &Certs{}
	for _, f := range []struct {
		path *string
		name string
		pair *keyPair
		key  bool
	}{
		{&c.CACert, "ca.pem", ca, false},
		{&c.ServerCert, "server.pem", server, false},
		{&c.ServerKey, "server-key.pem", server, true},
		{&c.ClientCert, "client.pem", client, false},
		{&c.ClientKey, "client-key.pem", client, true},
		{&c.OtherCACert, "other-ca.pem", otherCA, false},
		{&c.OtherClientCert, "other-client.pem", otherClient, false},
		{&c.OtherClientKey, "other-client-key.pem", otherClient, true},
	} {
		*f.path = filepath.Join(dir, f.name)
		block := &pem.Block{Type: "CERTIFICATE", Bytes: f.pair.der}
		if f.key {
			der, err := x509.MarshalPKCS8PrivateKey(f.pair.key)
			if err != nil {
				return nil, err
			}
			block = &pem.Block{Type: "PRIVATE KEY", Bytes: der}
		}
		if err := os.WriteFile(*f.path, pem.EncodeToMemory(block), 0o600); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// newCert signs template with parent's key (self-signed when parent is nil).
func newCert(parent *keyPair, template *x509.Certificate) (*keyPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, err
	}
	template.SerialNumber = serial
	template.NotBefore = time.Now().Add(-time.Hour)
	template.NotAfter = time.Now().Add(24 * time.Hour)
	signer, signerCert := key, template
	if parent != nil {
		signer, signerCert = parent.key, parent.cert
	}
	der, err := x509.CreateCertificate(rand.Reader, template, signerCert, &key.PublicKey, signer)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &keyPair{cert: cert, der: der, key: key}, nil
}
