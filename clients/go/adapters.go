package engine

import (
	"context"

	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// AdminKeyMetadata is the metadata key that carries the server's adapter admin key.
const AdminKeyMetadata = "x-admin-key"

// Adapter generates with a loaded LoRA adapter (its name, as loaded at launch with --adapter or by
// LoadAdapter); "" is the base model (the default). An unknown name is INVALID_ARGUMENT naming adapter.
func Adapter(name string) RequestOption {
	return func(r *enginev1.GenerateRequest) { r.Adapter = name }
}

// WithAdminKey returns ctx carrying the server's adapter admin key, for LoadAdapter, UnloadAdapter and
// ListAdapters on a server started with --admin-key (other calls need not carry it).
func WithAdminKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, AdminKeyMetadata, key)
}

// LoadAdapter loads a PEFT LoRA adapter from path (relative to the server's --adapter-dir) under name. An admin
// call: PERMISSION_DENIED unless the server enables adapter management (and ctx carries its admin key, see
// WithAdminKey); INVALID_ARGUMENT for a path outside the adapter directory, files the server refuses or a rank
// above its maximum (nothing is loaded); ALREADY_EXISTS for a loaded name.
func (c *Client) LoadAdapter(ctx context.Context, name, path string, opts ...grpc.CallOption) (*enginev1.AdapterInfo, error) {
	resp, err := c.rpc.LoadAdapter(ctx, &enginev1.LoadAdapterRequest{Name: name, Path: path}, opts...)
	if err != nil {
		return nil, err
	}
	return resp.GetAdapter(), nil
}

// UnloadAdapter unloads an adapter: NOT_FOUND for an unknown name, FAILED_PRECONDITION while requests use it.
func (c *Client) UnloadAdapter(ctx context.Context, name string, opts ...grpc.CallOption) error {
	_, err := c.rpc.UnloadAdapter(ctx, &enginev1.UnloadAdapterRequest{Name: name}, opts...)
	return err
}

// ListAdapters lists the loaded adapters with the requests using each now (an admin call).
func (c *Client) ListAdapters(ctx context.Context, opts ...grpc.CallOption) ([]*enginev1.AdapterInfo, error) {
	resp, err := c.rpc.ListAdapters(ctx, &enginev1.ListAdaptersRequest{}, opts...)
	if err != nil {
		return nil, err
	}
	return resp.GetAdapters(), nil
}
