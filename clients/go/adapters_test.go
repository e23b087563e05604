package engine_test

import (
	"context"
	"testing"

	engine "github.com/engine-project/engine/clients/go"
	enginev1 "github.com/engine-project/engine/gen/go/api/engine/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The fake's adapter calls: it loads any name whose call carries the admin key "adm" (and lists what it loaded).

func (f *fakeEngine) admin(ctx context.Context) error {
	md, _ := metadata.FromIncomingContext(ctx)
	if keys := md.Get(engine.AdminKeyMetadata); len(keys) != 1 || keys[0] != "adm" {
		return status.Error(codes.PermissionDenied, "admin key")
	}
	return nil
}

func (f *fakeEngine) LoadAdapter(ctx context.Context, req *enginev1.LoadAdapterRequest) (*enginev1.LoadAdapterResponse, error) {
	if err := f.admin(ctx); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.adapters = append(f.adapters, req.GetName())
	return &enginev1.LoadAdapterResponse{Adapter: &enginev1.AdapterInfo{Name: req.GetName(), Rank: 8}}, nil
}

func (f *fakeEngine) UnloadAdapter(ctx context.Context, req *enginev1.UnloadAdapterRequest) (*enginev1.UnloadAdapterResponse, error) {
	if err := f.admin(ctx); err != nil {
		return nil, err
	}
	return nil, status.Error(codes.NotFound, req.GetName())
}

func (f *fakeEngine) ListAdapters(ctx context.Context, _ *enginev1.ListAdaptersRequest) (*enginev1.ListAdaptersResponse, error) {
	if err := f.admin(ctx); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &enginev1.ListAdaptersResponse{}
	for _, name := range f.adapters {
		resp.Adapters = append(resp.Adapters, &enginev1.AdapterInfo{Name: name})
	}
	return resp, nil
}

func TestAdapterIsATopLevelField(t *testing.T) {
	req := engine.TextPrompt("x", engine.Adapter("sql"))
	if req.GetAdapter() != "sql" || req.Sampling != nil || req.Stopping != nil || req.Output != nil {
		t.Errorf("adapter %q (sub-messages set: %v)", req.GetAdapter(), req.Sampling != nil)
	}
	if engine.TextPrompt("x").GetAdapter() != "" {
		t.Error("the default is not the base model")
	}
}

func TestAdapterCallsCarryTheAdminKey(t *testing.T) {
	client, _ := startFake(t)
	ctx := testContext(t)
	if _, err := client.LoadAdapter(ctx, "sql", "sql"); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("LoadAdapter without the admin key: %v; want PERMISSION_DENIED", err)
	}
	admin := engine.WithAdminKey(ctx, "adm")
	info, err := client.LoadAdapter(admin, "sql", "sql")
	if err != nil || info.GetName() != "sql" || info.GetRank() != 8 {
		t.Fatalf("LoadAdapter = %v, %v", info, err)
	}
	listed, err := client.ListAdapters(admin)
	if err != nil || len(listed) != 1 || listed[0].GetName() != "sql" {
		t.Fatalf("ListAdapters = %v, %v", listed, err)
	}
	if err := client.UnloadAdapter(admin, "other"); status.Code(err) != codes.NotFound {
		t.Fatalf("UnloadAdapter of an unknown name: %v; want NOT_FOUND", err)
	}
}
